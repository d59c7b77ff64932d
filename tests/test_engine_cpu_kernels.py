"""The engine's CPU kernels (runtime/engine/cpu_kernels.py): torch's int4 and int8 CPU kernels on
the stored codes, in bfloat16, against the dequantized matrices in float32; and the engine in
bfloat16 with them as close to float32 as with dense bfloat16 weights.

They run on x86 CPUs with AVX2 or AVX-512 (elsewhere the engine keeps dense weights, and these
tests are skipped).
"""

from __future__ import annotations

import json

import pytest
import torch

from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.engine.cpu_kernels import (KERNEL_TOKENS_MAX, Int4CpuLinear, Int8CpuLinear, cpu_kernels_kept,
                                                 cpu_linear)

pytestmark = pytest.mark.skipif(not cpu_kernels_kept(torch.bfloat16), reason="no AVX2/AVX-512 CPU kernels here")

BF16_REL = 2e-2  # of the products' largest magnitude: bfloat16 inputs, scales and outputs


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A tiny random Gemma 3 in groups of 128: its 64-column matrices are half a group (the
    stored codes padded), its 128-column ones one; int8 rows for v_proj, down_proj and the head."""
    from helpers.random_gemma import build_random_gemma

    folder = tmp_path_factory.mktemp("cpu-kernels")
    source = build_random_gemma("gemma3-tiny", folder / "checkpoint")
    quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=128, shard_size=1 << 30))
    return open_artifact(folder / "artifact")


def _records(artifact):
    """One int4 record of each column count, and the int8 records of layer 0 and the head."""
    chosen, widths = [], set()
    for record in artifact.records:
        if record.scheme == "int4" and len(record.shape) == 2 and record.shape[1] not in widths:
            widths.add(record.shape[1])
            chosen.append(record.name)
        elif record.scheme == "int8" and (".0." in record.name or "embed_tokens" in record.name):
            chosen.append(record.name)
    return chosen


def _record(artifact, name):
    return next(r for r in artifact.records if r.name == name)


@pytest.mark.parametrize("tokens", [1, 3, KERNEL_TOKENS_MAX + 5])
def test_cpu_kernels_multiply_as_the_dequantized_matrix(artifact, tokens):
    names = _records(artifact)
    assert {_record(artifact, n).scheme for n in names} == {"int4", "int8"}
    assert any(_record(artifact, n).shape[1] % 128 for n in names)  # a matrix of part of a group
    for name in names:
        _check(artifact, _record(artifact, name), tokens)


def _check(artifact, record, tokens):
    linear = cpu_linear(artifact, record)
    assert isinstance(linear, Int8CpuLinear if record.scheme == "int8" else Int4CpuLinear)
    dense = artifact.decode(record, "cpu", torch.float32)
    x = torch.randn(tokens, record.shape[1]).to(torch.bfloat16)
    expected = x.float() @ dense.t()
    y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, record.shape[0])
    assert (y.float() - expected).abs().max() <= BF16_REL * expected.abs().max()
    # Batched rows are each the product of their own row: the first row alone gives the same answer.
    single = linear(x[:1]).float()
    assert (y[:1].float() - single).abs().max() <= BF16_REL * expected.abs().max()


def _teacher_forced(engine, tokens):
    """Logits [len(tokens) − 8, vocab] in float32: the first 8 tokens as one prefill chunk, then
    one token a step (the kernels' path)."""
    engine.reset()
    with torch.inference_mode():
        rows = [engine.step(torch.tensor(tokens[:8]), torch.arange(8), 8).float()]
        for position in range(8, len(tokens) - 1):
            rows.append(engine.step(torch.tensor([tokens[position]]), torch.tensor([position]), position + 1).float())
    return torch.stack(rows)


def _kl(reference, other) -> float:
    p, q = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("kind", ["e2b-tiny", "moe"])
def test_the_engine_in_bfloat16_is_as_close_to_float32_with_the_cpu_kernels_as_with_dense_weights(
        tmp_path_factory, monkeypatch, kind):
    """Teacher-forced over 24 steps: KL(float32 ‖ bfloat16) with the kernels within a small factor of
    KL(float32 ‖ dense bfloat16), which is what bfloat16 itself costs; every int4 and int8 matrix of
    the layers (and a MoE model's experts) in the kernels."""
    from helpers.random_gemma import build_random_gemma

    from gemmactl.runtime.engine.kernels import KERNEL_ENV
    from gemmactl.runtime.engine.model import GemmaModel

    folder = tmp_path_factory.mktemp(f"cpu-kernels-{kind}")
    source = build_random_gemma(kind, folder / "checkpoint")
    quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
    artifact = open_artifact(folder / "artifact")
    tokens = [2, 818, 5279, 529, 7001, 563, 496, 1401] + list(range(1000, 1025))
    exact = _teacher_forced(GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64), tokens)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.bfloat16, context=64)
    kernels = {linear.kernel for layer in engine.layers for linear in layer.linears().values()}
    assert kernels == {"int4-cpu", "int8-cpu"}
    with_kernels = _teacher_forced(engine, tokens)
    if kind == "moe":
        experts = engine.experts.store.linears(next(iter(engine.experts.store.records)), torch.device("cpu"))
        assert {linear.kernel for linear in experts} == {"int4-cpu"}
    monkeypatch.setenv(KERNEL_ENV, "dense")
    dense = _teacher_forced(GemmaModel(artifact, device="cpu", dtype=torch.bfloat16, context=64), tokens)
    kl_kernels, kl_dense = _kl(exact, with_kernels), _kl(exact, dense)
    assert 0 < kl_dense and kl_kernels <= 3 * kl_dense, (kl_kernels, kl_dense)


def test_experts_in_the_cpu_kernels_give_the_same_tokens_and_logits_whatever_the_cache(tmp_path_factory,
                                                                                       monkeypatch):
    """bfloat16 on the CPU, the experts in the int4 kernel: room for every expert, for a few (slots'
    rows overwritten as experts are evicted), for none, misses kept or computed on the host: token
    for token and bit for bit the fully cached engine. The first load writes every expert's layout
    to a file beside the artifact and later loads map it (nothing copied into rows); without the
    file (a read-only folder, a full disk) each expert is made on first use, with the same numbers;
    a damaged file is made again."""
    from gemmactl.runtime.engine import expert_layouts
    from helpers.random_gemma import build_random_gemma
    from test_engine import PROMPT, engine_greedy

    from gemmactl.runtime.engine.experts import ExpertSettings
    from gemmactl.runtime.engine.model import GemmaModel

    folder = tmp_path_factory.mktemp("cpu-kernels-moe-cache")
    source = build_random_gemma("moe", folder / "checkpoint")
    quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
    artifact = open_artifact(folder / "artifact")

    def engine(settings=None):
        return GemmaModel(artifact, device="cpu", dtype=torch.bfloat16, context=64, experts=settings)

    seen = []
    reference = engine(ExpertSettings(progress=lambda done, total: seen.append((done, total))))
    store = reference.experts.store
    assert store.layouts is not None and store.layouts.data.is_file()  # made by the first load
    assert len(seen) == len(store.records) and seen[-1][0] == seen[-1][1] == store.layouts.data.stat().st_size
    expected = engine_greedy(reference, PROMPT, 16, chunk=3)
    assert store.rows.nbytes() == 0 and store.made == 0  # mapped, never made or copied
    total = len(store.records)
    for slots in (0, 3, total // 4):
        for miss in ("copy", "cpu"):
            candidate = engine(ExpertSettings(cache_bytes=slots * store.expert_bytes, miss=miss))
            tokens, logits = engine_greedy(candidate, PROMPT, 16, chunk=3)
            assert tokens == expected[0] and torch.equal(logits, expected[1]), (slots, miss)
            stats = candidate.experts.stats()
            if miss == "copy" and slots:
                assert stats["misses"] > slots  # slots were reused
    data, index = store.layouts.data, store.layouts.index_path
    with open(data, "r+b") as handle:  # a damaged file (here, cut short) is not read: made again
        handle.truncate(data.stat().st_size // 2)
    again = engine()
    assert again.experts.store.layouts is not None and engine_greedy(again, PROMPT, 16, chunk=3)[0] == expected[0]
    assert data.stat().st_size == json.loads(index.read_text())["bytes"]
    monkeypatch.setattr(expert_layouts, "open_or_make", lambda *args: None)  # no file: made on first use
    unmapped = engine()
    tokens, logits = engine_greedy(unmapped, PROMPT, 16, chunk=3)
    assert tokens == expected[0] and torch.equal(logits, expected[1])
    assert unmapped.experts.store.rows.nbytes() > 0  # the slots' rows, made as experts were
