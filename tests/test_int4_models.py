"""int4-stream on models: tiny random Gemma 4 (dense + PLE, MoE) and the real Gemma 3 270M end to end."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke, run_gemmactl
from gemmactl.formats.int4.checkpoint import open_checkpoint
from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.quant import dequantize_int4, quantize_int4
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact
from helpers.int4_checkpoints import snap_checkpoint_to_grid

PROMPT_IDS = [2, 651, 6037, 576, 573, 3413, 603, 235248, 1000, 44567, 1312, 77, 5001, 9]


def _per_group(values, group_size):
    """[R, C] → [R, G] sums over groups of group_size columns (the last one may be short)."""
    pad = -values.shape[1] % group_size
    return torch.nn.functional.pad(values, (0, pad)).reshape(values.shape[0], -1, group_size).sum(-1)


@pytest.mark.parametrize("kind", ["dense-ple", "moe"])
def test_every_tensor_of_a_tiny_gemma4_is_accounted_for(tiny_gemma4, tmp_path, kind):
    source = tiny_gemma4(kind)
    checkpoint = open_checkpoint(source)
    quantize_checkpoint(source, tmp_path / "art", QuantizeOptions(group_size=32, shard_size=1 << 20))
    artifact = open_artifact(tmp_path / "art")
    assert artifact.verify() == []
    expected = {t.name: t for t in checkpoint.tensors}
    assert set(artifact.tensor_names()) == set(expected)
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        for name, tensor in expected.items():
            records = sorted(artifact._by_name[name], key=lambda r: r.expert or 0)
            original = handle.get_tensor(name).float()
            if len(tensor.shape) == 3 and ".experts." in name:
                assert [r.expert for r in records] == list(range(tensor.shape[0])), name
            decoded = artifact.load_tensor(name, dtype=torch.float32)
            assert decoded.shape == original.shape, name
            for record, part, want in zip(records, decoded.reshape(len(records), *records[0].shape), original.reshape(len(records), *records[0].shape)):
                if record.scheme == "int4":
                    # The fit is searched: per group, never a larger squared error than min/max.
                    plain = dequantize_int4(*quantize_int4(want, record.group_size), record.shape[1])
                    searched_error = _per_group((part - want).square(), record.group_size)
                    plain_error = _per_group((plain - want).square(), record.group_size)
                    assert bool((searched_error <= plain_error * (1 + 1e-6)).all()), record.key  # summation order
                elif record.scheme == "int8":
                    scales = artifact.packed(record).parts["scales"].float().unsqueeze(1)
                    assert bool(((part - want).abs() <= scales / 2 + want.abs() * 2**-11 + 2**-24).all()), record.key
                elif record.scheme == "raw":
                    assert torch.equal(part, want), record.key
    if kind == "moe":
        assert len(artifact.records) > len(expected)  # expert stacks split per expert
        assert artifact.record("model.layers.0.experts.gate_up_proj", 7).expert == 7


@pytest.mark.parametrize("kind", ["dense-ple", "moe"])
def test_a_tiny_gemma4_on_the_int4_grid_decodes_to_the_same_logits_and_tokens(tiny_gemma4, tmp_path, kind):
    """Random tiny models are chaotic (1% weight noise moves their logits a lot; docs/benchmarks.md),
    so closeness is checked where it is exact: weights already on the int4/int8 grid must come back
    bit for bit, giving the same logits and the same greedy tokens as the original model."""
    from transformers import AutoModelForCausalLM

    from gemmactl.runtime.int4_model import build_model

    source = snap_checkpoint_to_grid(tiny_gemma4(kind), tmp_path / "snapped", group_size=32)
    quantize_checkpoint(source, tmp_path / "art", QuantizeOptions(group_size=32))
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    dequantized = build_model(open_artifact(tmp_path / "art"), torch.float32)
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        want, got = original(ids).logits, dequantized(ids).logits  # [1, T, V]
        assert float((got - want).abs().max()) <= 1e-5
        tokens_want = original.generate(ids, max_new_tokens=12, do_sample=False)
        tokens_got = dequantized.generate(ids, max_new_tokens=12, do_sample=False)
    assert tokens_got.tolist() == tokens_want.tolist()


@pytest.mark.real_model
def test_gemma3_270m_int4_stream_answers_paris(gemma3_hf_checkpoint, runner, isolated_home):
    result = invoke(runner, ["quantize", str(gemma3_hf_checkpoint), "--int4-stream", "--group-size", "32", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    name = report["artifact"]["name"]
    assert report["compression"] > 2 and set(report["artifact"]["extra"]) >= {"scheme", "group_size"}
    proc = run_gemmactl(["run", "--model", name, "--temperature", "0", "--max-tokens", "8",
                         "Question: What is the capital of France?\nAnswer:"])
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_sampling_is_greedy_at_zero_and_repeatable_with_a_seed():
    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.int4_backend import sample_token

    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    greedy = GenerationRequest(prompt="x", temperature=0)
    assert sample_token(logits.clone(), [], greedy, torch.Generator()) == 1
    only_best = GenerationRequest(prompt="x", temperature=1.0, top_k=1)
    assert sample_token(logits.clone(), [], only_best, torch.Generator().manual_seed(3)) == 1
    wide = GenerationRequest(prompt="x", temperature=5.0, top_k=0, top_p=1.0)
    runs = [[sample_token(logits.clone(), [], wide, g) for _ in range(20)] for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    penalized = GenerationRequest(prompt="x", temperature=0, repeat_penalty=2.0)
    assert sample_token(logits.clone(), [1], penalized, torch.Generator()) == 2


@pytest.mark.real_model
def test_incremental_detokenizer_rebuilds_the_text_across_split_characters(gemma3_hf_checkpoint):
    from transformers import AutoTokenizer

    from gemmactl.runtime.int4_backend import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_checkpoint)
    prompt = tokenizer("Say:", add_special_tokens=False)["input_ids"]
    text = " naïve café 🙂 日本語 — ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.feed(token) for token in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
