"""Inventory from headers only: tiny random Gemma 4 checkpoints, the embedded GGUF, a header-only 26B-A4B."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from conftest import invoke

from gemmactl.plan.inventory import take_inventory
from gemmactl.plan.solver import Budget, Placement, evaluate

SL, FU = "sliding_attention", "full_attention"
# Gemma 4 26B-A4B's text configuration as released, in Gemma4TextConfig's fields.
GEMMA4_26B_A4B = dict(
    hidden_size=2816, num_hidden_layers=30, intermediate_size=2112, num_attention_heads=16, head_dim=256,
    global_head_dim=512, vocab_size=262_144, num_key_value_heads=8, num_global_key_value_heads=2,
    num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=1024, max_position_embeddings=262_144,
    attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    layer_types=([SL] * 5 + [FU]) * 5,
)


def file_tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a checkpoint's safetensors files: file size minus the header."""
    total = 0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        total += file.stat().st_size - 8 - length
    return total


@pytest.mark.parametrize("kind", ["dense-ple", "shared-kv", "moe"])
def test_tiny_checkpoint_inventory_equals_tensor_bytes(tiny_gemma4, tmp_path, kind):
    path = tiny_gemma4(kind)
    inventory = take_inventory(path)
    assert inventory.source == "safetensors" and inventory.shape.architecture == "gemma4"
    assert inventory.total_bytes + inventory.ignored_bytes == file_tensor_bytes(path)
    config = json.loads((path / "config.json").read_text())
    # The same config alone, sized at bf16, gives the same bytes per layer and kind.
    only = tmp_path / "config-only"
    only.mkdir()
    (only / "config.json").write_text(json.dumps(config))
    estimated = take_inventory(only, quant="BF16")
    assert estimated.source == "config"
    for real, guess in zip(inventory.layers, estimated.layers):
        for part in ("attention", "mlp", "experts", "per_layer"):
            # BF16 GGUF keeps 1-D norms in F32: allow exactly that difference.
            assert 0 <= guess.bytes[part] - real.bytes[part] <= 2 * sum(
                n for n in [config["hidden_size"] * 8, 512 * 2]), (kind, real.index, part)
    if kind == "moe":
        assert all(layer.bytes["experts"] > 0 for layer in inventory.layers)
        assert inventory.shape.n_experts == 8 and inventory.shape.experts_used == 2


def test_shared_kv_layers_hold_no_cache(tiny_gemma4):
    plain = take_inventory(tiny_gemma4("dense-ple"))
    shared = take_inventory(tiny_gemma4("shared-kv"))
    assert [layer.kv_heads for layer in shared.layers][5:] == [0] * 5
    assert all(layer.kv_heads == 1 for layer in plain.layers)
    profile_args = dict(context=4096, parallel=1)
    from gemmactl.plan.profile import load_profile

    profile = load_profile("desktop-4g")
    budget = Budget(4 << 30, 32 << 30)
    kv_plain = [layer.kv_bytes for layer in evaluate(plain, profile, budget, Placement(11), **profile_args).layers]
    kv_shared = [layer.kv_bytes for layer in evaluate(shared, profile, budget, Placement(11), **profile_args).layers]
    assert kv_shared[:5] == kv_plain[:5] and kv_shared[5:] == [0] * 5
    # sliding layers: window 16 + a 512-token micro-batch, padded to 256 cells; full layers: the context.
    assert [layer.kv_cells for layer in evaluate(plain, profile, budget, Placement(11), **profile_args).layers][:5] == [768] * 4 + [4096]


@pytest.mark.real_model
def test_gguf_inventory_matches_gguf_py(embedded_gguf):
    from gguf import GGUFReader

    inventory = take_inventory(embedded_gguf)
    reader = GGUFReader(embedded_gguf)
    assert inventory.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert inventory.quantization == "Q4_K_M" and inventory.shape.n_layers == 18
    assert [layer.sliding for layer in inventory.layers] == ([True] * 5 + [False]) * 3
    assert inventory.shape.sliding_window == 512 and inventory.shape.max_context == 32768
    per_layer = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.3."))
    assert sum(inventory.layers[3].bytes.values()) == per_layer


def test_gguf_type_table_matches_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES

    from gemmactl.formats.gguf_header import GGML_TYPES

    for type_id, (_, block, size) in GGML_TYPES.items():
        assert GGML_QUANT_SIZES[type_id] == (block, size)


def write_header_only_checkpoint(model, config: dict, out: Path, shards: int = 4) -> None:
    """safetensors files whose headers claim the real shapes, extended as sparse files: no weight bytes are written."""
    items = [(name, tuple(t.shape)) for name, t in model.state_dict().items() if name != "lm_head.weight"]
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    per_shard = -(-len(items) // shards)
    for number in range(shards):
        chunk = items[number * per_shard:(number + 1) * per_shard]
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for tensor, shape in chunk:
            size = 2
            for dim in shape:
                size *= dim
            header[tensor] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[tensor] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / name, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
        os.truncate(out / name, 8 + len(raw) + offset)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))


def test_header_only_26b_a4b_checkpoint(tmp_path):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(**GEMMA4_26B_A4B)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    path = tmp_path / "gemma-4-26B-A4B"
    write_header_only_checkpoint(model, config.to_dict(), path)
    inventory = take_inventory(path)
    assert inventory.total_bytes == file_tensor_bytes(path)
    assert inventory.shape.n_experts == 128 and inventory.shape.experts_used == 8
    expert_bytes = sum(layer.bytes["experts"] for layer in inventory.layers)
    assert expert_bytes == 30 * 128 * (2 * 704 * 2816 + 2816 * 704) * 2
    # every tensor of the state dict but the tied lm_head (parameters and the layer_scalar buffers)
    assert sum(t.numel() for n, t in model.state_dict().items() if n != "lm_head.weight") * 2 == inventory.total_bytes
    # Planned at Q4_K_M for a 16 GiB card: experts leave the GPU, dense layers stay.
    from gemmactl.plan.profile import load_profile
    from gemmactl.plan.solver import plan_placement

    q4 = take_inventory(path, quant="Q4_K_M")
    assert 0.25 < q4.total_bytes / inventory.total_bytes < 0.35
    plan = plan_placement(q4, load_profile("desktop-4g"), Budget(8 << 30, 32 << 30), context=8192)
    assert plan.gpu_bytes <= 8 << 30
    assert plan.placement.cpu_expert_layers and all(layer.device == "gpu" for layer in plan.layers)


def test_a_config_alone_plans_for_q4_k_m_and_says_so(runner, tmp_path):
    # The README's example: plan a model from its config.json before downloading a byte of it.
    from transformers import Gemma4TextConfig

    folder = tmp_path / "gemma-4-26B-A4B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(Gemma4TextConfig(**GEMMA4_26B_A4B).to_dict()))
    explicit = take_inventory(folder, quant="Q4_K_M")
    for ref in (folder, folder / "config.json"):
        result = invoke(runner, ["plan", str(ref), "--vram", "4G", "--ram", "32G", "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["model"]["source"] == "config" and data["model"]["quantization"] == "Q4_K_M"
        assert data["model"]["total_bytes"] == explicit.total_bytes
        assert any("no --quant given: planned for Q4_K_M" in note for note in data["notes"])
    # --quant still wins, and then no note says it was chosen for the user.
    data = json.loads(invoke(runner, ["plan", str(folder), "--vram", "4G", "--quant", "Q8_0", "--json"]).stdout)
    assert data["model"]["quantization"] == "Q8_0" and not any("no --quant" in note for note in data["notes"])
