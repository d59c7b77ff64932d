"""Full-size random-weight checkpoints shaped like real Gemma models, for speed measurements.

Random weights run exactly as fast as trained ones of the same shapes and quantization, so these
stand in for models whose weights are not available on a measuring machine. Each gets a real
tokenizer: Gemma 4 from llama.cpp's `ggml-vocab-gemma-4.gguf`.

    python benchmarks/random_models.py e2b OUT_DIR --vocab path/to/ggml-vocab-gemma-4.gguf [--device cuda]
    python benchmarks/random_models.py gemma3-270m OUT_DIR --vocab ...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SLIDING, FULL = "sliding_attention", "full_attention"

# The published Gemma 4 E2B text configuration (35 layers, the last 20 reading shared KV).
E2B = dict(
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    vocab_size=262_144,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    layer_types=([SLIDING] * 4 + [FULL]) * 7,
    max_position_embeddings=131_072,
)

# Gemma 3 270M, as recorded in the embedded GGUF's metadata (same shapes, so the same speed).
GEMMA3_270M = dict(
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    sliding_window=512,
    vocab_size=262_144,
    max_position_embeddings=32_768,
    layer_types=([SLIDING] * 5 + [FULL]) * 3,
)


def build(kind: str, out: Path, vocab: Path, device: str = "cpu") -> Path:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

    from gemmactl.formats.gguf_vocab import write_hf_tokenizer

    torch.manual_seed(0)
    # Built on the target device: random initialisation of billions of parameters on the CPU
    # takes minutes, on a GPU seconds.
    with torch.device(device):
        if kind == "e2b":
            model = Gemma4ForCausalLM(Gemma4TextConfig(**E2B))
        else:
            model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_270M))
    model = model.to(dtype=torch.bfloat16)
    model.save_pretrained(out)
    write_hf_tokenizer(vocab, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["e2b", "gemma3-270m"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    start = time.perf_counter()
    build(args.kind, args.out, args.vocab, args.device)
    print(f"{args.kind}: saved to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
