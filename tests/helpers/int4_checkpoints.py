"""Small hand-made checkpoints for int4-stream tests (any tensors, any config)."""

from __future__ import annotations

import json
from pathlib import Path


def make_checkpoint(path: Path, tensors: dict, config: dict | None = None) -> Path:
    """Write tensors (name → torch tensor) as model.safetensors plus a config.json into path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "gemma3_text"}))
    return path


def small_tensors(seed: int = 0) -> dict:
    """A few tensors of every kind the planner tells apart, some with rows not divisible by 32."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 40, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(48, 40, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(40, 100, generator=g).to(torch.float32),
        "model.layers.0.input_layernorm.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "model.layers.1.experts.gate_up_proj": torch.randn(4, 64, 40, generator=g).to(torch.bfloat16),
        "model.layers.1.experts.down_proj": torch.randn(4, 40, 32, generator=g).to(torch.bfloat16),
        "model.layers.1.router.proj.weight": torch.randn(4, 40, generator=g).to(torch.bfloat16),
        "model.layers.1.layer_scalar": torch.ones(1, dtype=torch.bfloat16),
    }


def snap_checkpoint_to_grid(source: Path, target: Path, group_size: int) -> Path:
    """Copy a checkpoint with every weight moved onto the grid int4-stream will store it on.

    Each int4 group gets codes 0 and 15 at its first two places (so its min and max are grid
    points) and each int8 row a code of 127, then the weights are decoded and saved in float32:
    quantizing the result again is lossless, so the artifact must decode to the same bits.
    """
    import torch
    from safetensors.torch import load_file

    from gemmactl.formats.int4.checkpoint import open_checkpoint
    from gemmactl.formats.int4.layout import QuantizeOptions, plan_layout
    from gemmactl.formats.int4.quant import (
        dequantize_int4,
        dequantize_int8_rows,
        pack_nibbles,
        quantize_int4,
        quantize_int8_rows,
        unpack_nibbles,
    )

    def snap_int4(w):
        packed, scales, zeros = quantize_int4(w, group_size)
        codes = unpack_nibbles(packed).reshape(w.shape[0], -1, group_size)  # [R, G, g]
        codes[:, :, 0], codes[:, :, 1] = 0, 15
        return dequantize_int4(pack_nibbles(codes.reshape(w.shape[0], -1)), scales, zeros, w.shape[1])

    def snap_int8(w):
        q, scales = quantize_int8_rows(w)
        q[:, 0] = 127
        return dequantize_int8_rows(q, scales)

    tensors = {name: t.float() for name, t in load_file(str(Path(source) / "model.safetensors")).items()}
    layout = plan_layout(open_checkpoint(source), QuantizeOptions(group_size=group_size))
    for record in layout.records:
        snap = {"int4": snap_int4, "int8": snap_int8}.get(record.scheme)
        if snap is not None:
            if record.expert is None:
                tensors[record.name] = snap(tensors[record.name])
            else:
                tensors[record.name][record.expert] = snap(tensors[record.name][record.expert])
    config = json.loads((Path(source) / "config.json").read_text())
    config["dtype"] = "float32"
    return make_checkpoint(target, {name: t.to(torch.float32) for name, t in tensors.items()}, config)
