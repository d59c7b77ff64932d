"""int4-stream golden tests: bit layout, groups, error bounds, the layout plan, the index and the writer."""

from __future__ import annotations

import json

import pytest
import torch

from gemmactl.formats.int4.checkpoint import open_checkpoint
from gemmactl.formats.int4.layout import QuantizeOptions, plan_layout
from gemmactl.formats.int4.quant import (
    dequantize_int4,
    dequantize_int8_rows,
    int4_error_bound,
    pack_nibbles,
    quantize_int4,
    quantize_int8_rows,
    unpack_nibbles,
)
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.formats.int4.spec import (
    ALIGNMENT,
    HEADER_SIZE,
    PART_ALIGNMENT,
    TensorRecord,
    pack_header,
    unpack_header,
)
from gemmactl.formats.int4.writer import Int4ShardWriter, WriterStateError
from helpers.int4_checkpoints import make_checkpoint, small_tensors

# -- bit layout ---------------------------------------------------------------------------------


def test_pack_puts_the_even_code_in_the_low_nibble():
    codes = torch.tensor([1, 2, 3, 4, 15, 0], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert bytes(packed.numpy()) == bytes([0x21, 0x43, 0x0F])
    assert torch.equal(unpack_nibbles(packed), codes)


def test_unpack_inverts_pack_for_every_byte():
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(every)), every)


def test_a_hand_computed_group_encodes_to_known_bytes():
    w = torch.arange(16, dtype=torch.float32).reshape(1, 16) * 0.5  # 0.0, 0.5, ..., 7.5
    packed, scales, zeros = quantize_int4(w, 16)
    # min 0, max 7.5 → scale 0.5, zero 0.0: the codes are 0..15 in order, two per byte.
    assert bytes(packed.numpy()) == bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    assert bytes(scales.numpy()) == bytes([0x00, 0x38])  # 0.5 as float16, little-endian
    assert bytes(zeros.numpy()) == bytes([0x00, 0x00])
    assert torch.equal(dequantize_int4(packed, scales, zeros, 16), w)


def test_asymmetric_zero_is_the_group_minimum():
    w = torch.tensor([[-3.0, -1.0, 1.0, 4.5] * 8])  # one group of 32: min -3, max 4.5
    packed, scales, zeros = quantize_int4(w, 32)
    assert zeros.item() == -3.0 and scales.item() == 0.5
    assert torch.equal(dequantize_int4(packed, scales, zeros, 32), w)  # every value is on the grid


# -- groups and rows not divisible by the group ------------------------------------------------


@pytest.mark.parametrize("cols, group", [(40, 32), (100, 64), (1, 32), (129, 128), (96, 32)])
def test_rows_not_divisible_by_the_group_pad_the_last_group(cols, group):
    w = torch.randn(3, cols, generator=torch.Generator().manual_seed(cols))
    packed, scales, zeros = quantize_int4(w, group)
    groups = -(-cols // group)
    assert packed.shape == (3, groups * group // 2) and scales.shape == zeros.shape == (3, groups)
    decoded = dequantize_int4(packed, scales, zeros, cols)
    assert decoded.shape == (3, cols)
    bound = int4_error_bound(scales, zeros).repeat_interleave(group, dim=1)[:, :cols]
    assert bool(((decoded - w).abs() <= bound).all())
    # The padding repeats the row's last value, so the last group's range is the real values' range.
    last = w[:, (groups - 1) * group :]
    assert torch.allclose(zeros[:, -1].float(), last.amin(dim=1), atol=1e-2)


def test_a_constant_group_decodes_exactly():
    w = torch.full((2, 64), 0.125)
    packed, scales, zeros = quantize_int4(w, 32)
    assert bool((scales == 0).all())
    assert torch.equal(dequantize_int4(packed, scales, zeros, 64), w)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequant_error_is_within_half_a_step_per_group(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(64, 1000, generator=g) * 0.05
    w[5, 17] = 3.0  # an outlier widens its own group only
    packed, scales, zeros = quantize_int4(w, group)
    decoded = dequantize_int4(packed, scales, zeros, 1000)
    bound = int4_error_bound(scales, zeros).repeat_interleave(group, dim=1)[:, :1000]  # [R, C]
    error = (decoded - w).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    # The bound is tight: the worst group error comes close to half its step.
    assert float((error / bound).max()) > 0.9


def test_int8_rows_round_to_half_a_step():
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(1))
    q, scales = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (50,)
    decoded = dequantize_int8_rows(q, scales)
    step = scales.float().unsqueeze(1)
    assert bool(((decoded - w).abs() <= step / 2 + w.abs() * 2**-10).all())


# -- header, records, plan, index ---------------------------------------------------------------


def test_shard_header_round_trip():
    header = pack_header(2, 3, b"\x11" * 32)
    assert len(header) == HEADER_SIZE
    assert unpack_header(header) == {"version": 1, "number": 2, "count": 3, "fingerprint": b"\x11" * 32}
    assert unpack_header(b"GGUF" + header[4:]) is None


def test_record_json_round_trip_and_validation():
    record = TensorRecord("w", (4, 40), "bfloat16", "int4", 32, 3, None, None, "shard-00001-of-00001.i4s", 4096, 200,
                          {"qweight": (4096, 128), "scales": (4224, 16), "zeros": (4288, 16)}, "crc32:00000001")
    assert TensorRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    broken = record.to_json() | {"parts": {"qweight": [4096, 128]}}
    with pytest.raises(ValueError):
        TensorRecord.from_json(broken)


def test_plan_orders_by_layer_then_expert_and_aligns_records(tmp_path):
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "ckpt", small_tensors()))
    layout = plan_layout(checkpoint, QuantizeOptions(group_size=32))
    keys = [r.key for r in layout.records]
    assert keys[0] == "model.embed_tokens.weight"  # embeddings lead the globals
    layers = [r.layer for r in layout.records if r.layer is not None]
    assert layers == sorted(layers)
    experts = [(r.expert, r.name) for r in layout.records if r.expert is not None]
    assert experts == sorted(experts)  # expert 0's slices of every stack, then expert 1's, ...
    for r in layout.records:
        assert r.offset % ALIGNMENT == 0 and r.offset >= HEADER_SIZE
        assert all(offset % PART_ALIGNMENT == 0 for offset, _ in r.parts.values())
    schemes = {r.key: r.scheme for r in layout.records}
    assert schemes["model.embed_tokens.weight"] == "int8"
    assert schemes["model.layers.0.self_attn.q_proj.weight"] == "int4"
    assert schemes["model.layers.1.router.proj.weight"] == "raw"  # routing stays exact
    assert schemes["model.norm.weight"] == "raw"
    assert schemes["model.layers.1.experts.down_proj#3"] == "int4"


def test_an_int4_head_of_its_own_is_quantized_from_the_tied_table(tmp_path):
    """`--head int4`: a tied model gets an lm_head.weight record in int4 groups, made from the
    token table (which stays int8 rows); the head's values are the table's, to an int4 step."""
    tensors = small_tensors()
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "ckpt", tensors))
    plain = plan_layout(checkpoint, QuantizeOptions(group_size=32))
    assert "lm_head.weight" not in {r.name for r in plain.records} and "head" not in plain.scheme
    layout = plan_layout(checkpoint, QuantizeOptions(group_size=32, head="int4"))
    head = next(r for r in layout.records if r.name == "lm_head.weight")
    assert (head.scheme, head.group_size, head.shape, head.layer) == ("int4", 32, (300, 40), None)
    assert layout.source_of(head) == "model.embed_tokens.weight" and layout.scheme["head"] == "int4"
    assert layout.fingerprint != plain.fingerprint

    artifact = open_artifact(quantize_checkpoint(tmp_path / "ckpt", tmp_path / "art",
                                                 QuantizeOptions(group_size=32, head="int4")).out_dir)
    assert artifact.record("model.embed_tokens.weight").scheme == "int8"
    params = sum(t.numel() for t in tensors.values())  # the copied head is stored, not counted as the model's
    assert artifact.index["totals"]["params"] == params and artifact.index["scheme"]["head"] == "int4"
    table = tensors["model.embed_tokens.weight"].float()
    decoded = artifact.load_tensor("lm_head.weight", "cpu", torch.float32)
    step = (table.abs().max() * 2) / 15  # a group's step is at most its range over 15 levels
    assert (decoded - table).abs().max() <= step


def test_a_model_with_its_own_head_or_an_untied_config_gets_no_second_head(tmp_path):
    from gemmactl.errors import InvalidOptionError

    tensors = small_tensors()
    table = tensors["model.embed_tokens.weight"]
    with_head = open_checkpoint(make_checkpoint(tmp_path / "a", {**tensors, "lm_head.weight": table.clone()}))
    untied = open_checkpoint(make_checkpoint(tmp_path / "b", tensors, {"model_type": "gemma3_text", "tie_word_embeddings": False}))
    nested = open_checkpoint(make_checkpoint(tmp_path / "c", tensors, {"model_type": "gemma4", "tie_word_embeddings": True,
                                                                       "text_config": {"tie_word_embeddings": False}}))
    for checkpoint in (with_head, untied, nested):
        layout = plan_layout(checkpoint, QuantizeOptions(group_size=32, head="int4"))
        assert [r.name for r in layout.records].count("lm_head.weight") == (1 if checkpoint is with_head else 0)
        assert not layout.sources and "head" not in layout.scheme  # nothing added, nothing said
    # Gemma 4's table sits under language_model; a tower's table is not the head's.
    gemma4 = {("model.language_model." + name.removeprefix("model.")): t for name, t in tensors.items()}
    gemma4["model.vision_tower.embed_tokens.weight"] = table[:8].clone()
    layout = plan_layout(open_checkpoint(make_checkpoint(tmp_path / "d", gemma4)), QuantizeOptions(group_size=32, head="int4"))
    assert layout.sources == {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    two = {**tensors, "model.other.embed_tokens.weight": table.clone()}
    with pytest.raises(InvalidOptionError, match="needs the one token table a tied head reads"):
        plan_layout(open_checkpoint(make_checkpoint(tmp_path / "e", two)), QuantizeOptions(group_size=32, head="int4"))
    with pytest.raises(InvalidOptionError, match="--head must be one of tied, int4"):
        QuantizeOptions(head="int8").check()
    with pytest.raises(InvalidOptionError, match="adds nothing to --embeddings int4"):
        QuantizeOptions(head="int4", embeddings="int4").check()


def test_index_round_trip(tmp_path):
    source = make_checkpoint(tmp_path / "ckpt", small_tensors(), {"model_type": "gemma3_text", "hidden_size": 40})
    result = quantize_checkpoint(source, tmp_path / "art", QuantizeOptions(group_size=32), source="test-model")
    index = json.loads((tmp_path / "art" / "index.json").read_text())
    assert list(index)[:2] == ["format", "version"]
    assert index["format"] == "gemmactl-int4-stream" and index["version"] == 1
    assert index["source"]["model"] == "test-model" and index["source"]["fingerprint"].startswith("sha256:")
    assert index["config"] == {"model_type": "gemma3_text", "hidden_size": 40}
    assert index["scheme"]["group_size"] == 32 and index["scheme"]["embeddings"] == "int8"
    for entry in index["tensors"]:
        assert {"shard", "offset", "nbytes", "shape", "dtype", "scheme", "group_size", "layer", "expert", "checksum"} <= set(entry)
    artifact = open_artifact(tmp_path / "art")
    assert [r.to_json() for r in artifact.records] == index["tensors"] == result.index["tensors"]
    assert artifact.verify() == []
    # Every source tensor comes back with its shape and dtype.
    for name, tensor in small_tensors().items():
        decoded = artifact.load_tensor(name)
        assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype, name
        assert torch.allclose(decoded.float(), tensor.float(), atol=0.6), name
    assert torch.equal(artifact.load_tensor("model.norm.weight"), small_tensors()["model.norm.weight"])


def test_layer_and_expert_loads_are_single_contiguous_spans(tmp_path):
    quantize_checkpoint(make_checkpoint(tmp_path / "ckpt", small_tensors()), tmp_path / "art", QuantizeOptions(group_size=32))
    artifact = open_artifact(tmp_path / "art")
    expert = artifact.load_expert(1, 2)
    assert set(expert) == {"model.layers.1.experts.gate_up_proj", "model.layers.1.experts.down_proj"}
    assert expert["model.layers.1.experts.down_proj"].shape == (40, 32)
    shard, offset, nbytes = artifact.span(1, 2)
    members = [r for r in artifact.records if r.layer == 1 and r.expert == 2]
    assert all(r.shard == shard and offset <= r.offset and r.offset + r.nbytes <= offset + nbytes for r in members)
    layer = artifact.load_layer(1)
    assert layer["model.layers.1.experts.gate_up_proj"].shape == (4, 64, 40)
    assert "model.layers.1.experts.gate_up_proj" not in artifact.load_layer(1, experts=False)
    packed = artifact.packed(artifact.record("model.layers.0.self_attn.q_proj.weight"))
    assert packed.parts["qweight"].dtype == torch.uint8 and packed.parts["qweight"].shape == (48, 32)


# -- the writer's state machine -----------------------------------------------------------------


def test_writer_refuses_calls_out_of_order(tmp_path):
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "ckpt", small_tensors()))
    layout = plan_layout(checkpoint, QuantizeOptions(group_size=32))
    out = tmp_path / "out"
    out.mkdir()
    writer = Int4ShardWriter(out, layout)
    first, second = layout.records[0], layout.records[1]
    with pytest.raises(WriterStateError, match="needs shard-open"):
        writer.begin_record(first)
    with pytest.raises(WriterStateError, match="out of order"):
        writer.open_shard("shard-00009-of-00009.i4s")
    writer.open_shard(layout.shards[0][0])
    with pytest.raises(WriterStateError, match="out of order"):
        writer.begin_record(second)
    writer.begin_record(first)
    with pytest.raises(WriterStateError, match="not fully written"):
        writer.end_record()
    with pytest.raises(WriterStateError, match="outside"):
        writer.write_part("qweight", 0, b"\x00" * (first.parts["qweight"][1] + 1))
    with pytest.raises(WriterStateError, match="needs ready"):
        writer.finish({})
    writer.abort()
    assert not list(out.glob("*.partial"))


def test_decoding_on_an_accelerator_goes_a_block_of_rows_at_a_time_with_the_same_values(tmp_path, monkeypatch):
    """Off the CPU, decode copies and dequantizes blocks of rows (bounded temporaries); the values
    are those of the whole-matrix decode. "cpu:0" takes the accelerator's path on this machine."""
    import gemmactl.formats.int4.reader as reader

    quantize_checkpoint(make_checkpoint(tmp_path / "ckpt", small_tensors()), tmp_path / "art", QuantizeOptions(group_size=32))
    artifact = open_artifact(tmp_path / "art")
    monkeypatch.setattr(reader, "DEVICE_BLOCK_VALUES", 7 * 40)  # 7 rows of the 300-row table per block
    schemes = set()
    for record in artifact.records:
        if len(record.shape) != 2:
            continue
        schemes.add(record.scheme)
        whole = artifact.decode(record, "cpu", torch.bfloat16)
        blocks = artifact.decode(record, torch.device("cpu", 0), torch.bfloat16)
        assert torch.equal(whole, blocks), record.name
    assert {"int4", "int8"} <= schemes
