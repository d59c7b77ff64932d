"""The packed int4 runtime: weights kept as stored, dequantized per call, bit for bit the dense model."""

from __future__ import annotations

import pytest
import torch

from conftest import invoke, run_gemmactl
from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact

PROMPT_IDS = [2, 651, 6037, 576, 573, 3413, 603, 235248, 1000, 44567, 1312, 77, 5001, 9]


def _greedy(model, ids, steps):
    """Greedy tokens from a plain forward loop over the model's cache (what the int4 backend runs)."""
    import inspect

    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, step, tokens = None, ids, []
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=step, use_cache=True, **{arg: cache})
            cache = out[arg] if arg in out else out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            step = torch.tensor([[token]])
    return tokens


@pytest.mark.parametrize("kind", ["dense-ple", "moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_gives_the_dense_models_logits_and_tokens_bit_for_bit(tiny_gemma4, tmp_path, kind, dtype):
    from gemmactl.runtime.int4_model import build_model
    from gemmactl.runtime.int4_packed import PackedEmbedding, PackedLinear, build_packed_model

    quantize_checkpoint(tiny_gemma4(kind), tmp_path / "art", QuantizeOptions(group_size=32, embeddings="int8"))
    artifact = open_artifact(tmp_path / "art")
    dense = build_model(artifact, dtype)
    packed = build_packed_model(artifact, dtype)
    linears = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    tables = [m for m in packed.modules() if isinstance(m, PackedEmbedding)]
    assert {m.scheme for m in linears} == {"int4", "int8"}  # --sensitive int8 kinds stay int8
    assert len(tables) == (2 if kind == "dense-ple" else 1)  # token + per-layer embeddings
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, dense(ids).logits)
    assert _greedy(packed, ids, 12) == _greedy(dense, ids, 12)


def test_packed_model_keeps_weights_packed_and_lookup_tables_mapped(tiny_gemma4, tmp_path):
    from gemmactl.runtime.int4_packed import PackedEmbedding, PackedLinear, build_packed_model, packed_bytes

    quantize_checkpoint(tiny_gemma4("dense-ple"), tmp_path / "art", QuantizeOptions(group_size=32, embeddings="int8"))
    artifact = open_artifact(tmp_path / "art")
    model = build_packed_model(artifact, torch.bfloat16)
    dense_params = sum(p.numel() for p in model.parameters())
    quantized = sum(r.numel for r in artifact.records if r.scheme in ("int4", "int8"))
    total = sum(r.numel for r in artifact.records)
    assert dense_params <= total - quantized  # only norms, scalars, ... are dense (some are buffers)
    modules = dict(model.named_modules())
    for record in artifact.records:
        if record.scheme in ("int4", "int8") and record.expert is None:
            assert isinstance(modules[record.name.rpartition(".")[0]], (PackedLinear, PackedEmbedding)), record.name
    stored = sum(r.nbytes for r in artifact.records if r.scheme in ("int4", "int8"))
    assert packed_bytes(model) <= stored  # parts as stored (headers and padding aside), none twice
    # The tied head multiplies by the token table's own parts; the per-layer table stays a lookup.
    head, token_table = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, PackedLinear) and isinstance(token_table, PackedEmbedding)
    assert head.qweight.data_ptr() == token_table.parts["qweight"].data_ptr()
    # Nothing of a table is a buffer, so moving the model to a GPU leaves lookup tables in RAM.
    for table in (m for m in model.modules() if isinstance(m, PackedEmbedding)):
        assert dict(table.named_buffers()) == {} and table.embed_scale is not None
    # On the CPU the parts are views of the mapped shard, not copies.
    mapped = artifact._maps[artifact.record(token_table.name).shard]
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    assert base <= token_table.parts["qweight"].data_ptr() < base + len(mapped)


@pytest.mark.real_model
def test_gemma3_270m_packed_answers_as_the_dense_backend(gemma3_hf_checkpoint, runner, isolated_home):
    """The transformers path (GEMMACTL_INT4_ENGINE=off) with packed and dense weights, and the
    engine the int4 backend now is: one greedy answer."""
    import json

    result = invoke(runner, ["quantize", str(gemma3_hf_checkpoint), "--int4-stream", "--json"])
    assert result.exit_code == 0, result.stderr
    name = json.loads(result.stdout)["artifact"]["name"]
    question = ["run", "--model", name, "--temperature", "0", "--max-tokens", "8",
                "Question: What is the capital of France?\nAnswer:"]
    reference = {"GEMMACTL_INT4_ENGINE": "off"}
    packed = run_gemmactl(question, env=reference | {"GEMMACTL_INT4_WEIGHTS": "packed"})
    dense = run_gemmactl(question, env=reference | {"GEMMACTL_INT4_WEIGHTS": "dense"})
    engine = run_gemmactl(question)
    assert packed.returncode == dense.returncode == engine.returncode == 0, packed.stderr + dense.stderr + engine.stderr
    assert "Paris" in packed.stdout
    assert packed.stdout == dense.stdout == engine.stdout
    bad = run_gemmactl(question, env=reference | {"GEMMACTL_INT4_WEIGHTS": "sparse"})
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr and "unknown int4 weights mode 'sparse'" in bad.stderr
