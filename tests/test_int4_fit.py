"""int4-stream quality: the squared-error search, activation importance, and the sensitive-tensor policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import invoke
from gemmactl.formats.int4.calibrate import Calibration, collect_importance
from gemmactl.formats.int4.checkpoint import open_checkpoint
from gemmactl.formats.int4.layout import QuantizeOptions, plan_layout
from gemmactl.formats.int4.quant import (
    dequantize_int4,
    group_sq_error,
    pack_nibbles,
    pad_to_groups,
    quantize_int4,
    quantize_int4_search,
    unpack_nibbles,
)
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact
from helpers.int4_checkpoints import make_checkpoint, small_tensors


def _group_errors(w, importance, group_size, result):
    """[R, G] weighted squared error of a quantize result, from its decoded values."""
    packed, scales, zeros = result
    rows, cols = w.shape
    weight = torch.ones(cols) if importance is None else importance
    weight = torch.cat((weight, weight.new_zeros(-cols % group_size))).reshape(1, -1, group_size)
    decoded = pad_to_groups(dequantize_int4(packed, scales, zeros, cols), group_size)  # [R, Cp]
    error = (decoded - pad_to_groups(w, group_size)).reshape(rows, -1, group_size).square() * weight
    return error.sum(-1)


# -- the search ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cols, group", [(256, 32), (200, 64), (129, 128), (40, 32)])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_is_never_worse_than_min_max_in_any_group(cols, group, weighted):
    g = torch.Generator().manual_seed(cols + group)
    w = torch.randn(64, cols, generator=g) * torch.rand(64, 1, generator=g) * 3  # rows of varied scale
    w[0, :7] = 40.0  # an outlier group
    w[1] = 0.25  # a constant row
    importance = torch.rand(cols, generator=g).square() * 10 if weighted else None
    plain = _group_errors(w, importance, group, quantize_int4(w, group))
    searched = _group_errors(w, importance, group, quantize_int4_search(w, group, importance))
    assert bool((searched <= plain).all())
    assert float(searched.sum()) < 0.9 * float(plain.sum())  # and it does find better fits


def test_search_keeps_the_bit_layout_and_decodes_as_the_codes_say():
    w = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    packed, scales, zeros = quantize_int4_search(w, 32)
    plain = quantize_int4(w, 32)
    assert packed.shape == plain[0].shape and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == plain[1].shape and scales.dtype == zeros.dtype == torch.float16
    codes = unpack_nibbles(packed).reshape(8, -1, 32).float()  # [R, G, g]
    by_hand = (codes * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(8, -1)[:, :100]
    assert torch.equal(dequantize_int4(packed, scales, zeros, 100), by_hand)
    assert torch.equal(pack_nibbles(unpack_nibbles(packed)), packed)


def test_search_reproduces_weights_that_already_lie_on_an_int4_grid():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    codes[:, 0], codes[:, 1], codes[:, 32], codes[:, 33] = 0, 15, 0, 15  # every group spans the whole grid
    scales = (torch.rand(16, 2, generator=g) / 10 + 0.01).to(torch.float16)
    zeros = (torch.randn(16, 2, generator=g)).to(torch.float16)
    w = dequantize_int4(pack_nibbles(codes), scales, zeros, 64)
    for importance in (None, torch.rand(64, generator=g)):
        packed, s, z = quantize_int4_search(w, 32, importance)
        assert torch.equal(dequantize_int4(packed, s, z, 64), w)


def test_importance_moves_the_error_onto_columns_that_matter_less():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 128, generator=g)
    importance = torch.ones(128)
    importance[::4] = 100.0  # every fourth input is loud
    plain = quantize_int4_search(w, 32)
    weighted = quantize_int4_search(w, 32, importance)
    assert float(_group_errors(w, importance, 32, weighted).sum()) < 0.8 * float(_group_errors(w, importance, 32, plain).sum())


def test_group_sq_error_matches_the_decoded_error():
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    packed, scales, zeros = quantize_int4(w, 32)
    groups = w.reshape(5, 2, 32)
    assert torch.allclose(group_sq_error(groups, torch.ones_like(groups), scales, zeros), _group_errors(w, None, 32, (packed, scales, zeros)))


# -- the sensitive-tensor policy and the scheme ---------------------------------------------------


def _tensors():
    tensors = small_tensors()
    g = torch.Generator().manual_seed(5)
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.randn(32, 40, generator=g).to(torch.bfloat16)
    return tensors


def test_sensitive_int8_keeps_v_proj_and_down_proj_at_int8_but_not_experts(tmp_path):
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "ckpt", _tensors()))
    schemes = {
        policy: {r.key: r.scheme for r in plan_layout(checkpoint, QuantizeOptions(sensitive=policy)).records}
        for policy in ("int8", "int4")
    }
    for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert schemes["int8"][name] == "int8" and schemes["int4"][name] == "int4"
    assert schemes["int8"]["model.layers.0.self_attn.q_proj.weight"] == "int4"
    assert schemes["int8"]["model.layers.1.experts.down_proj#0"] == "int4"  # experts stay int4


def test_the_scheme_records_the_policy_and_the_plan_changes_with_it(tmp_path):
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "ckpt", _tensors()))
    text = tmp_path / "calib.txt"
    text.write_text("Some calibration text.\n")
    layouts = {
        "default": plan_layout(checkpoint, QuantizeOptions()),
        "int4": plan_layout(checkpoint, QuantizeOptions(sensitive="int4")),
        "minmax": plan_layout(checkpoint, QuantizeOptions(search=False)),
        "calibrated": plan_layout(checkpoint, QuantizeOptions(calibration=Calibration.from_file(text, tokens=64))),
    }
    assert layouts["default"].scheme["sensitive"] == "int8" and layouts["default"].scheme["fit"] == "mse-search"
    assert layouts["minmax"].scheme["fit"] == "minmax" and layouts["default"].scheme["calibration"] is None
    calibration = layouts["calibrated"].scheme["calibration"]
    assert calibration["text"] == "calib.txt" and calibration["tokens"] == 64 and len(calibration["sha256"]) == 64
    # A resumed run must never mix shards of different settings: each setting is its own plan.
    assert len({layout.fingerprint for layout in layouts.values()}) == 4


def test_minmax_fit_writes_what_it_always_wrote_and_search_fits_better(tmp_path):
    tensors = _tensors()
    source = make_checkpoint(tmp_path / "ckpt", tensors)
    errors = {}
    for fit in ("minmax", "mse-search"):
        out = tmp_path / fit
        quantize_checkpoint(source, out, QuantizeOptions(sensitive="int4", search=fit == "mse-search"))
        artifact = open_artifact(out)
        assert artifact.verify() == []
        name = "model.layers.0.self_attn.q_proj.weight"
        parts = artifact.packed(artifact.record(name)).parts
        w = tensors[name].float()
        if fit == "minmax":
            packed, scales, zeros = quantize_int4(w, 32)
            assert torch.equal(parts["qweight"], packed) and torch.equal(parts["scales"], scales)
        errors[fit] = float((artifact.load_tensor(name, dtype=torch.float32) - w).square().sum())
    assert errors["mse-search"] < errors["minmax"]


def test_an_artifact_without_the_new_scheme_keys_still_reads_and_inspects(tmp_path, runner):
    out = tmp_path / "art"
    quantize_checkpoint(make_checkpoint(tmp_path / "ckpt", _tensors()), out, QuantizeOptions())
    index = json.loads((out / "index.json").read_text())
    for key in ("sensitive", "fit", "calibration"):
        del index["scheme"][key]
    (out / "index.json").write_text(json.dumps(index))
    assert open_artifact(out).verify() == []
    result = invoke(runner, ["inspect", str(out), "--verify"])
    assert result.exit_code == 0, result.stderr
    assert "embeddings int8)" in result.stdout and "sensitive" not in result.stdout


# -- calibration ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_gemma4, gemma3_hf_checkpoint, tmp_path_factory) -> Path:
    """A tiny random Gemma 4 with the Gemma 3 tokenizer files (same vocabulary size)."""
    folder = tmp_path_factory.mktemp("tiny-tok")
    for item in tiny_gemma4("dense-ple").iterdir():
        shutil.copy(item, folder / item.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma3_hf_checkpoint / name, folder / name)
    return folder


@pytest.mark.real_model
def test_importance_is_the_mean_square_of_each_linear_layers_inputs(tiny_with_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    importance = collect_importance(tiny_with_tokenizer, Calibration.from_file(text, tokens=40))
    names = {t.name for t in open_checkpoint(tiny_with_tokenizer).tensors}
    linear = {n for n in names if n.endswith("proj.weight") and ".layers." in n}
    assert linear <= set(importance)
    # Recompute one by hand: the inputs of layer 0's q_proj over the same 40 tokens behind BOS.
    model = AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_with_tokenizer)
    ids = [tokenizer.bos_token_id, *tokenizer(text.read_text(), add_special_tokens=False)["input_ids"][:40]]
    seen = []
    module = model.model.layers[0].self_attn.q_proj
    handle = module.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0].float()))
    with torch.inference_mode():
        model(torch.tensor([ids]))
    handle.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])  # [T, C]
    assert torch.allclose(importance["model.layers.0.self_attn.q_proj.weight"], x.square().mean(0), rtol=1e-5)


@pytest.mark.real_model
def test_quantize_calibration_end_to_end(tiny_with_tokenizer, runner, tmp_path, isolated_home):
    text = tmp_path / "calib.txt"
    text.write_text("Calibration is about typical inputs, not the evaluation text. " * 20)
    plain = invoke(runner, ["quantize", str(tiny_with_tokenizer), "--int4-stream", "--out", str(tmp_path / "a"), "--json"])
    calibrated = invoke(
        runner,
        ["quantize", str(tiny_with_tokenizer), "--int4-stream", "--calibration", str(text), "--out", str(tmp_path / "b"), "--json"],
    )
    assert plain.exit_code == 0 and calibrated.exit_code == 0, calibrated.stderr
    assert json.loads(calibrated.stdout)["artifact"]["extra"]["calibration"] == "calib.txt"
    a, b = open_artifact(tmp_path / "a"), open_artifact(tmp_path / "b")
    assert b.scheme["calibration"]["sha256"] and a.scheme["calibration"] is None
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a.packed(a.record(name)).parts["scales"], b.packed(b.record(name)).parts["scales"])
    assert b.verify() == []
    shown = invoke(runner, ["inspect", str(tmp_path / "b")])
    assert "calibrated on calib.txt" in shown.stdout and "sensitive int8" in shown.stdout


@pytest.mark.parametrize(
    "content, args, expected",
    [
        (b"", [], "is empty"),
        (b"\xff\xfe\x00bad", [], "not a readable UTF-8 text file"),
        (b"fine text", ["--imatrix"], "--imatrix goes with --gguf"),
    ],
)
def test_bad_calibration_input_is_one_line_exit_2(content, args, expected, tmp_path, isolated_home):
    from conftest import run_gemmactl

    checkpoint = make_checkpoint(tmp_path / "ckpt", _tensors())
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    extra = ["--imatrix", str(text)] if args else ["--calibration", str(text)]
    proc = run_gemmactl(["quantize", str(checkpoint), "--int4-stream", *extra])
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


# -- decoding into other dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoding_rounds_the_float32_value_once_across_row_blocks(dtype):
    from gemmactl.formats.int4.quant import dequantize_int8_rows, quantize_int8_rows

    w = torch.randn(2000, 200, generator=torch.Generator().manual_seed(6)) * 2  # several row blocks, padded groups
    packed, scales, zeros = quantize_int4_search(w, 64)
    codes = unpack_nibbles(packed).reshape(2000, -1, 64).float()  # [R, G, g]
    by_hand = (codes * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(2000, -1)[:, :200]
    assert torch.equal(dequantize_int4(packed, scales, zeros, 200, dtype), by_hand.to(dtype))
    q, row_scales = quantize_int8_rows(w)
    assert torch.equal(dequantize_int8_rows(q, row_scales, dtype), (q.float() * row_scales.float()[:, None]).to(dtype))
