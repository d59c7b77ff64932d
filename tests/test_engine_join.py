"""Matrices that read one input joined into one product (kernels.join_linears, Layer.join).

On the CPU the engine keeps them apart by default; GEMMACTL_ENGINE_JOIN=on joins them there too,
so the same code is held here: the same greedy tokens, logits within float32 rounding, in every
placement. On a GPU the joined tinygemm, Triton and int8 kernels give the parts' outputs side by
side.
"""

from __future__ import annotations

import pytest
import torch

from test_engine import PROMPT, STEPS, artifacts, engine_greedy  # noqa: F401 (a fixture)

gpu = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny", "moe"])
def test_joined_matrices_decode_the_same_tokens(artifacts, kind, monkeypatch):  # noqa: F811
    from gemmactl.runtime.engine.model import GATE_UP, GemmaModel
    from gemmactl.runtime.engine.placement import HOST, RESIDENT, STREAMED, EnginePlacement

    artifact = artifacts(kind)
    monkeypatch.setenv("GEMMACTL_ENGINE_JOIN", "off")
    apart = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64)
    assert all("q" in layer.linears() and "gate" in layer.linears() for layer in apart.layers)
    expected, expected_logits = engine_greedy(apart, PROMPT, STEPS, chunk=5)
    n = apart.spec.n_layers
    monkeypatch.setenv("GEMMACTL_ENGINE_JOIN", "on")
    for placement in (EnginePlacement.all_resident(n),
                      EnginePlacement((RESIDENT,) * (n // 2) + (STREAMED,) * (n - n // 2)),
                      EnginePlacement(tuple((STREAMED, HOST, RESIDENT)[i % 3] for i in range(n)), tables_on_host=True)):
        joined = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, placement=placement)
        for layer in joined.layers:
            if placement.layers[layer.spec.index] == STREAMED:
                layer = joined.staged_layers[layer.spec.index][0]
            names = set(layer.linears())
            assert GATE_UP in names and not {"gate", "up"} & names
            parts = ("q", "k", "v") if layer.spec.owns_kv and not layer.spec.k_eq_v else (
                ("q", "k") if layer.spec.owns_kv else ())
            assert layer.attn.joined_parts == (parts if len(parts) > 1 else ())
            assert not set(parts if len(parts) > 1 else ()) & names
        if placement.resident_only:  # joined, the same bytes
            assert joined.memory()["weights_device_bytes"] == apart.memory()["weights_device_bytes"]
        tokens, logits = engine_greedy(joined, PROMPT, STEPS, chunk=5)
        assert tokens == expected
        assert (logits - expected_logits).abs().max() <= 1e-5 * expected_logits.abs().max()


def test_only_matrices_of_one_kernel_and_shape_of_input_are_joined():
    from gemmactl.runtime.engine.kernels import Int8Linear, Linear, join_linears

    a, b = Linear(torch.randn(8, 16)), Linear(torch.randn(4, 16))
    joined = join_linears([a, b])
    x = torch.randn(3, 16)
    assert joined.out_features == 12 and torch.allclose(joined(x), torch.cat([a(x), b(x)], dim=-1))
    assert join_linears([a, Linear(torch.randn(4, 8))]) is None  # another input width
    assert join_linears([a, Int8Linear(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4))]) is None
    assert join_linears([a]) is None


@gpu
@pytest.mark.parametrize("kernel", ["tinygemm", "groups", "int8"])
def test_gpu_joined_kernels_give_the_parts_side_by_side(kernel):
    """tinygemm's layout tiles output rows by 8, so joined codes are the parts' codes one after
    the other: the joined product is the parts' products side by side, one token and several (up
    to the order of sums: the Triton GEMVs choose their K split and tile by the matrix's rows)."""
    from gemmactl.formats.int4.quant import quantize_int4
    from gemmactl.runtime.engine.kernels import Int4GroupsLinear, Int4Linear, Int8Linear, join_linears, tinygemm_layout

    torch.manual_seed(0)
    parts = []
    for rows in (256, 64, 64):
        w = torch.randn(rows, 512, device="cuda")
        if kernel == "int8":
            scale = w.abs().amax(dim=1) / 127
            parts.append(Int8Linear((w / scale[:, None]).round().to(torch.int8), scale.half()))
            continue
        qweight, scales, zeros = quantize_int4(w, 32)
        if kernel == "tinygemm":
            parts.append(Int4Linear(*tinygemm_layout(qweight, scales, zeros, 512), 32, rows, 512))
        else:
            parts.append(Int4GroupsLinear(qweight, scales, zeros, 512))
    joined = join_linears(parts)
    for tokens in (1, 5):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        expected = torch.cat([p(x) for p in parts], dim=-1).float()
        assert (joined(x).float() - expected).abs().max() <= 4e-3 * expected.abs().max()
