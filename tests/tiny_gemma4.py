"""Tiny random Gemma 4 checkpoints, shaped like the real ones (layer patterns, PLE, shared KV, MoE).

Their layer patterns mirror the real models': llama.cpp aborts on KV-shared layers that do not
line up with the sliding/full pattern.
"""

from __future__ import annotations

from pathlib import Path

SLIDING, FULL = "sliding_attention", "full_attention"

_COMMON = dict(
    vocab_size=262_144,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    sliding_window=16,
    max_position_embeddings=4096,
    vocab_size_per_layer_input=262_144,
)

TINY_CONFIGS: dict[str, dict] = {
    # E2B/E4B style: per-layer embeddings, (4 sliding + 1 full) × 2.
    "dense-ple": dict(
        _COMMON, num_hidden_layers=10, layer_types=([SLIDING] * 4 + [FULL]) * 2, hidden_size_per_layer_input=16
    ),
    # The same with the last 5 layers reading the KV of earlier layers (the E2B/E4B arrangement).
    "shared-kv": dict(
        _COMMON,
        num_hidden_layers=10,
        layer_types=([SLIDING] * 4 + [FULL]) * 2,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=5,
    ),
    # 26B-A4B style: (5 sliding + 1 full) × 2, 8 experts top-2, K = V with one global KV head.
    "moe": dict(
        _COMMON,
        num_hidden_layers=12,
        layer_types=([SLIDING] * 5 + [FULL]) * 2,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
}


def tiny_gemma4_config(kind: str):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**TINY_CONFIGS[kind])


def build_tiny_gemma4(kind: str, out_dir: Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Save a random tiny Gemma 4 text model (safetensors + config) into out_dir."""
    import torch
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(tiny_gemma4_config(kind)).to(getattr(torch, dtype)).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
