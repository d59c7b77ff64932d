"""`gemmactl quantize --gguf`: HF checkpoint → GGUF through the build's converter and llama-quantize."""

from __future__ import annotations

import json

import pytest

from conftest import run_gemmactl

PROMPT_IDS = [2, 818, 5279, 529, 7001, 563, 496, 1401]  # BOS + a few ordinary tokens


def transformers_greedy(checkpoint, prompt_ids, steps):
    """Greedy tokens from transformers (float32), with each step's full logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            step = model(ids).logits[0, -1]
            tokens.append(int(step.argmax()))
            logits.append(step.numpy())
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logits


def llama_cpp_runs(gguf_path, prompt_ids, forced, steps):
    """llama.cpp's free-running greedy tokens, and its argmax at each step fed the forced tokens."""
    from gemmactl.runtime.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(str(gguf_path), context_size=256, extra_args={"logits_all": True})
    try:
        llm = backend._llm
        llm.reset()
        free = []
        for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0):
            free.append(token)
            if len(free) == steps:
                break
        llm.reset()
        llm.eval(prompt_ids + forced[:-1])
        start = len(prompt_ids) - 1
        teacher = [int(llm.scores[start + i].argmax()) for i in range(steps)]
        return free, teacher
    finally:
        backend.close()


# Random tiny models have near-ties: a pair of logits closer than 2% of the logits' spread is a
# tie that float16 weights may break either way. Anything wider must agree exactly.
TIE = 0.02


@pytest.mark.parametrize("kind", ["dense-ple", "shared-kv", "moe"])
def test_gguf_f16_greedy_tokens_equal_transformers(kind, built_home, tiny_checkpoint):
    checkpoint = tiny_checkpoint(kind)
    proc = run_gemmactl(["quantize", str(checkpoint), "--gguf", "F16", "--json"])
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)
    assert entry["name"] == f"tiny-gemma4-{kind}-F16" and entry["format"] == "gguf"
    assert entry["extra"]["architecture"] == "Gemma4ForCausalLM"
    expected, logits = transformers_greedy(checkpoint, PROMPT_IDS, 16)
    free, teacher = llama_cpp_runs(entry["path"], PROMPT_IDS, expected, 16)
    ties = []
    for step, (want, got, row) in enumerate(zip(expected, teacher, logits)):
        if got != want:
            gap = float(row[want] - row[got])
            assert gap < TIE * float(row.std()), f"step {step}: llama.cpp {got} vs transformers {want}, gap {gap:.4f}"
            ties.append(step)
    # Free-running greedy must match token for token up to the first near-tie (all 16 without one).
    first_tie = ties[0] if ties else 16
    assert free[:first_tie] == expected[:first_tie]
    assert len(ties) <= 1, f"near-ties at steps {ties}"
    # intermediates are gone; only the GGUF is left next to it
    assert [p.name for p in (built_home / "models" / entry["name"]).iterdir()] == [f"{entry['name']}.gguf"]


@pytest.mark.real_model
def test_q8_0_of_the_real_gemma3_answers_paris(built_home, gemma3_hf_checkpoint):
    proc = run_gemmactl(["quantize", str(gemma3_hf_checkpoint), "--gguf", "q8_0", "--json"])
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)
    assert entry["extra"]["quantization"] == "Q8_0"
    run = run_gemmactl(["run", "--model", entry["name"], "--temperature", "0", "--max-tokens", "8",
                        "Question: What is the capital of France?\nAnswer:"])
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    listing = json.loads(run_gemmactl(["list", "--json"]).stdout)
    assert entry["name"] in [item["name"] for item in listing]


# -- bad input --------------------------------------------------------------------------------------


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_unknown_type_lists_the_valid_ones(tiny_gemma4):
    proc = run_gemmactl(["quantize", str(tiny_gemma4("moe")), "--gguf", "Q9_X"])
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "unknown GGUF type 'Q9_X'" in line and "Q4_K_M" in line and "Q8_0" in line


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    proc = run_gemmactl(["quantize", str(tmp_path), "--gguf", "Q4_K_M"])
    assert proc.returncode == 2
    assert "LlamaForCausalLM" in _one_line(proc.stderr)


def test_without_a_build_says_to_build_first(tiny_gemma4, isolated_home):
    proc = run_gemmactl(["quantize", str(tiny_gemma4("moe")), "--gguf", "Q4_K_M"])
    assert proc.returncode == 1
    assert "gemmactl build" in _one_line(proc.stderr)
    assert not (isolated_home / "manifest.json").exists()


def test_existing_output_needs_force(built_home, tiny_checkpoint):
    checkpoint = tiny_checkpoint("moe")
    first = run_gemmactl(["quantize", str(checkpoint), "--gguf", "Q8_0", "--json"])
    assert first.returncode == 0, first.stderr
    again = run_gemmactl(["quantize", str(checkpoint), "--gguf", "Q8_0"])
    assert again.returncode == 2 and "--force" in _one_line(again.stderr)
    forced = run_gemmactl(["quantize", str(checkpoint), "--gguf", "Q8_0", "--force", "--json"])
    assert forced.returncode == 0, forced.stderr


def test_calibration_text_makes_an_importance_matrix(built_home, tiny_checkpoint, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 200))
    proc = run_gemmactl(["quantize", str(tiny_checkpoint("dense-ple")), "--gguf", "Q4_K_M", "--calibration", str(text), "--json"])
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)
    assert entry["extra"]["imatrix"] == f"calibration:{text}"
    log = next((built_home / "logs").glob("quantize-*Q4_K_M.log"))
    assert "llama-imatrix" in log.read_text() and "--imatrix" in log.read_text()


def test_converter_and_quantizer_output_becomes_progress():
    from gemmactl.formats.gguf import _QUANTIZED, _converter_progress

    seen = []
    line = _converter_progress(lambda step, done, total: seen.append((step, done, total)), 3)
    for text in ["INFO:hf-to-gguf:Loading model: x", "INFO:hf-to-gguf:blk.0.attn_k.weight,  torch.bfloat16 --> BF16, shape = {64, 32}",
                 "INFO:hf-to-gguf:blk.0.attn_q.weight,  torch.bfloat16 --> BF16, shape = {64, 64}",
                 "Writing:  45%|████▌     | 241M/536M [00:02<00:03, 98.7Mbyte/s]", "Writing: 100%|██████████| 536M/536M"]:
        line(text)
    assert seen == [("convert", 0, 3), ("convert", 1, 3), ("convert", 2, 3), ("write", 45, 100), ("write", 100, 100)]
    match = _QUANTIZED.match("[  12/ 340]                 blk.1.attn_k.weight - [  640,   256,     1,     1], type =   bf16")
    assert match and (int(match.group(1)), int(match.group(2))) == (12, 340)


def test_a_random_gguf_written_directly_has_the_converters_tensors_and_runs(built_home, tiny_checkpoint, llama_source,
                                                                           gemma4_vocab, tmp_path):
    """random_gemma.write_random_gguf (what the 26B-A4B benchmark's llama.cpp side uses, since the
    bfloat16 route does not fit the GPU machine's disk) gives a tiny MoE kind the tensors, shapes
    and model metadata the build's converter and llama-quantize give its saved checkpoint, and
    llama.cpp loads it and decodes finite logits."""
    import numpy as np
    from gguf import GGUFReader

    from gemmactl.runtime.llamacpp import LlamaCppBackend
    from helpers.random_gemma import write_random_gguf

    proc = run_gemmactl(["quantize", str(tiny_checkpoint("moe")), "--gguf", "Q4_K_M", "--json"])
    assert proc.returncode == 0, proc.stderr
    converted = GGUFReader(json.loads(proc.stdout)["path"])
    made = GGUFReader(write_random_gguf("moe", tmp_path / "random.gguf", llama_source, vocab=gemma4_vocab))

    shapes = lambda reader: {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # noqa: E731
    assert shapes(made) == shapes(converted)

    def model_keys(reader):
        return {name: field.contents() for name, field in reader.fields.items()
                if name.startswith("gemma4.") or name in ("general.architecture", "general.file_type")}

    assert model_keys(made) == model_keys(converted)
    assert len(made.fields["tokenizer.ggml.tokens"].data) == len(converted.fields["tokenizer.ggml.tokens"].data)

    backend = LlamaCppBackend(str(tmp_path / "random.gguf"), context_size=64, extra_args={"logits_all": True})
    try:
        backend._llm.eval(PROMPT_IDS)
        assert np.isfinite(backend._llm.scores[len(PROMPT_IDS) - 1]).all()
    finally:
        backend.close()
