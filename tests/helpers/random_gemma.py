"""Random-weight Gemma checkpoints shaped like the real ones: tiny for tests, full size for benchmarks.

Tiny Gemma 4 kinds (layer patterns, per-layer embeddings, shared KV, MoE) mirror the real models'
patterns: llama.cpp aborts on KV-shared layers that do not line up with the sliding/full pattern.
Full-size kinds (the published Gemma 4 E2B text configuration; Gemma 3 270M as recorded in the
embedded GGUF) stand in for models whose weights a measuring machine does not have: random
weights run exactly as fast as trained ones of the same shapes and quantization.

    python tests/helpers/random_gemma.py e2b OUT_DIR --vocab ggml-vocab-gemma-4.gguf [--device cuda]
    python tests/helpers/random_gemma.py 26b-a4b OUT_DIR --vocab ggml-vocab-gemma-4.gguf --int4-stream
    python tests/helpers/random_gemma.py 26b-a4b OUT.gguf --vocab ggml-vocab-gemma-4.gguf --gguf-from LLAMA_CPP_SRC
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SLIDING, FULL = "sliding_attention", "full_attention"

_TINY = dict(
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
        _TINY, num_hidden_layers=10, layer_types=([SLIDING] * 4 + [FULL]) * 2, hidden_size_per_layer_input=16
    ),
    # The same with the last 5 layers reading the KV of earlier layers (the E2B/E4B arrangement).
    "shared-kv": dict(
        _TINY,
        num_hidden_layers=10,
        layer_types=([SLIDING] * 4 + [FULL]) * 2,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=5,
    ),
    # The E2B arrangement in full: shared KV, double-wide MLPs in the sharing layers, a final softcap.
    "e2b-tiny": dict(
        _TINY,
        num_hidden_layers=10,
        layer_types=([SLIDING] * 4 + [FULL]) * 2,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    ),
    # The E4B arrangement: (5 sliding + 1 full) × 2, grouped queries (2 per KV head), shared KV.
    "e4b-tiny": dict(
        _TINY,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=([SLIDING] * 5 + [FULL]) * 2,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=4,
        final_logit_softcapping=30.0,
    ),
    # 26B-A4B style: (5 sliding + 1 full) × 2, 8 experts top-2, K = V with one global KV head.
    "moe": dict(
        _TINY,
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

# Gemma 4 E4B's text shape (42 layers, (5 sliding + 1 full) × 7, the last 18 reading shared KV;
# llama.cpp's gemma4 loader knows a 42-layer model as E4B, hidden 2560, feed-forward 10240).
E4B = dict(
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=42,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    sliding_window=512,
    vocab_size=262_144,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    num_kv_shared_layers=18,
    final_logit_softcapping=30.0,
    layer_types=([SLIDING] * 5 + [FULL]) * 7,
    max_position_embeddings=131_072,
)

# Gemma 4 26B-A4B's text shape: 30 layers, (5 sliding + 1 full) × 5, 128 experts of width 704 with
# 8 used per token beside a dense MLP of 2112, global layers with 2 KV heads whose keys are their
# values (llama.cpp's gemma4 loader knows a 30-layer model as 26B-A4B). 25.2B parameters, 22.8B
# of them in experts: written straight to int4-stream (write_random_int4), never as a checkpoint.
A26B = dict(
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    sliding_window=1024,
    vocab_size=262_144,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    attention_k_eq_v=True,
    final_logit_softcapping=30.0,
    layer_types=([SLIDING] * 5 + [FULL]) * 5,
    max_position_embeddings=262_144,
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

# Gemma 3 in miniature: (5 sliding + 1 full) × 2, a window the tests' sequences run past.
GEMMA3_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, sliding_window=16, vocab_size=262_144, max_position_embeddings=4096, query_pre_attn_scalar=32,
    layer_types=([SLIDING] * 5 + [FULL]) * 2,
)

FULL_SIZE = {"e2b": ("gemma4", E2B), "e4b": ("gemma4", E4B), "26b-a4b": ("gemma4", A26B), "gemma3-270m": ("gemma3", GEMMA3_270M), "gemma3-tiny": ("gemma3", GEMMA3_TINY)}
KINDS = tuple(TINY_CONFIGS) + tuple(FULL_SIZE)


def gemma_config(kind: str):
    """The transformers text config of a kind."""
    from transformers import Gemma3TextConfig, Gemma4TextConfig

    if kind in TINY_CONFIGS:
        return Gemma4TextConfig(**TINY_CONFIGS[kind])
    family, values = FULL_SIZE[kind]
    return (Gemma4TextConfig if family == "gemma4" else Gemma3TextConfig)(**values)


def tiny_gemma4_config(kind: str):
    return gemma_config(kind)


def build_random_gemma(kind: str, out_dir: Path, *, seed: int = 0, dtype: str = "bfloat16", device: str = "cpu",
                       vocab: Path | None = None) -> Path:
    """Save a random Gemma text model (safetensors + config) into out_dir; vocab: a llama.cpp vocabulary
    GGUF whose tokenizer is written beside it (Gemma 4's ggml-vocab-gemma-4.gguf)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM

    torch.manual_seed(seed)
    config = gemma_config(kind)
    model_class = Gemma3ForCausalLM if config.model_type.startswith("gemma3") else Gemma4ForCausalLM
    # Built on the target device: random initialisation of billions of parameters on the CPU
    # takes minutes, on a GPU seconds.
    with torch.device(device):
        model = model_class(config)
    model = model.to(getattr(torch, dtype)).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if vocab is not None:
        from gemmactl.formats.gguf_vocab import write_hf_tokenizer

        write_hf_tokenizer(vocab, out_dir)
    return out_dir


def build_random_assistant(target_kind: str, out_dir: Path, *, seed: int = 1, layers: int = 2) -> Path:
    """Save a random Gemma 4 MTP assistant (Gemma4AssistantForCausalLM) for a tiny target kind:
    `layers` layers (sliding ones, then a full one) that read the target's KV, with the target's
    head dimensions and half its width (llama.cpp needs the assistant narrower than its backbone)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    target = TINY_CONFIGS[target_kind]
    text = Gemma4TextConfig(**{
        **target, "num_hidden_layers": layers, "layer_types": [SLIDING] * (layers - 1) + [FULL],
        "hidden_size": target["hidden_size"] // 2, "intermediate_size": target["intermediate_size"] // 2,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "num_kv_shared_layers": layers,
        "use_double_wide_mlp": False, "enable_moe_block": False,
    })
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text,
                                                             backbone_hidden_size=target["hidden_size"]))
    model.to(torch.bfloat16).eval().save_pretrained(Path(out_dir))
    return Path(out_dir)


def write_random_int4(kind: str, out_dir: Path, *, seed: int = 0, vocab: Path | None = None, group_size: int = 64,
                      progress=None, embed_from: Path | None = None, sensitive: str = "int8",
                      embeddings: str = "int8", head: str = "tied") -> Path:
    """Write a random model of a kind straight to an int4-stream artifact: the records a quantized
    checkpoint of it would have, with random codes and sane scales, and no checkpoint on disk or
    in memory (one block of rows at a time). Decoded weights are uniform with the standard
    deviation of transformers' initialisation (0.02); norms and scalars are ones, as it makes them.

    embed_from: another artifact of the same vocabulary and a hidden size no larger: this model's
    token embedding (and so its tied head) is that one's, its rows padded with zeros (a target and
    draft whose logits agree where their layers add little: benchmarks/speculation_gpu.py).
    sensitive, embeddings, head: the layout `gemmactl quantize --int4-stream` takes as --sensitive,
    --embeddings (int8 rows by default; int4 for an artifact with every matrix in groups) and --head."""
    import json
    import tempfile
    import zlib

    import torch

    from gemmactl.formats.int4.checkpoint import Checkpoint, SourceTensor
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import write_artifact
    from gemmactl.formats.int4.spec import padded_cols

    config, shapes = _meta_shapes(kind)
    std = 0.02
    width = std * 12 ** 0.5  # a uniform spread of that deviation

    def block_rows(numel_per_row: int) -> int:
        return max(1, (16 << 20) // max(numel_per_row, 1))

    donor = None
    if embed_from is not None:
        from gemmactl.formats.int4.reader import open_artifact

        donor = open_artifact(Path(embed_from))

    def encode(record, writer) -> None:
        if donor is not None and record.name.endswith("embed_tokens.weight"):
            return _padded_copy(donor, record, writer)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{record.key}".encode()))
        rows = record.shape[0] if record.shape else 1
        cols = record.numel // max(rows, 1)
        if record.scheme == "raw":
            values = (torch.ones(record.shape) if len(shapes[record.name]) <= 1
                      else torch.rand(record.shape, generator=generator).sub_(0.5).mul_(width))
            data = values.to(getattr(torch, record.dtype)).contiguous().reshape(-1)
            writer.write_part("data", 0, memoryview(data.view(torch.uint8).numpy()))
            return
        step = block_rows(cols)
        for start in range(0, rows, step):
            n = min(rows, start + step) - start
            if record.scheme == "int4":
                groups = padded_cols(cols, record.group_size) // record.group_size
                codes = torch.randint(0, 256, (n, groups * record.group_size // 2), dtype=torch.uint8, generator=generator)
                scales = torch.full((n, groups), width / 15, dtype=torch.float16)
                zeros = torch.full((n, groups), -width / 2, dtype=torch.float16)
                writer.write_part("qweight", start * groups * record.group_size // 2, memoryview(codes.numpy()))
                writer.write_part("scales", start * groups * 2, memoryview(scales.view(torch.uint8).numpy()))
                writer.write_part("zeros", start * groups * 2, memoryview(zeros.view(torch.uint8).numpy()))
            else:  # int8 rows
                q = torch.randint(-127, 128, (n, cols), dtype=torch.int8, generator=generator)
                scales = torch.full((n,), width / 254, dtype=torch.float16)
                writer.write_part("qweight", start * cols, memoryview(q.view(torch.uint8).numpy()))
                writer.write_part("scales", start * 2, memoryview(scales.view(torch.uint8).numpy()))

    with tempfile.TemporaryDirectory() as source:
        folder = Path(source)
        config.to_json_file(folder / "config.json")
        if vocab is not None:
            from gemmactl.formats.gguf_vocab import write_hf_tokenizer

            write_hf_tokenizer(vocab, folder)
        tensors = tuple(SourceTensor(name, shape, "bfloat16", folder / "random") for name, shape in shapes.items())
        checkpoint = Checkpoint(folder, json.loads((folder / "config.json").read_text()), tensors,
                                f"random:{kind}:{seed}")
        write_artifact(checkpoint, Path(out_dir), QuantizeOptions(group_size=group_size, search=False, sensitive=sensitive,
                                                                embeddings=embeddings, head=head), encode=encode,
                       progress=progress)
    return Path(out_dir)


def _padded_copy(donor, record, writer) -> None:
    """record's parts from donor's record of the same name, each row padded with zero weights."""
    import torch

    parts = donor.packed(donor.record(record.name)).parts
    rows, cols = record.shape
    if record.scheme not in ("int8", "int4") or donor.record(record.name).scheme != record.scheme:
        raise ValueError(f"{record.name}: cannot pad a {donor.record(record.name).scheme} table into {record.scheme}")
    step = max(1, (16 << 20) // cols)
    for start in range(0, rows, step):
        block = slice(start, min(rows, start + step))
        if record.scheme == "int8":
            q = parts["qweight"][block]
            q = torch.cat((q, q.new_zeros((q.shape[0], cols - q.shape[1]))), 1).contiguous()
            writer.write_part("qweight", start * cols, memoryview(q.view(torch.uint8).numpy()))
            writer.write_part("scales", start * 2, memoryview(parts["scales"][block].contiguous().view(torch.uint8).numpy()))
            continue
        from gemmactl.formats.int4.spec import padded_cols

        groups = padded_cols(cols, record.group_size) // record.group_size
        pieces = {}
        for name in ("qweight", "scales", "zeros"):
            part = parts[name][block]
            width = groups * record.group_size // 2 if name == "qweight" else groups
            pieces[name] = torch.cat((part, part.new_zeros((part.shape[0], width - part.shape[1]))), 1).contiguous()
        writer.write_part("qweight", start * groups * record.group_size // 2, memoryview(pieces["qweight"].numpy()))
        for name in ("scales", "zeros"):  # zero scales and zeros: the padded columns decode to 0
            writer.write_part(name, start * groups * 2, memoryview(pieces[name].view(torch.uint8).numpy()))


def _meta_shapes(kind: str):
    """(config with its architecture, {tensor name: shape}) as save_pretrained would write the kind."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM

    config = gemma_config(kind)
    model_class = Gemma3ForCausalLM if config.model_type.startswith("gemma3") else Gemma4ForCausalLM
    config.architectures = [model_class.__name__]
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in model_class(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # as save_pretrained leaves it out
    return config, shapes


def write_sparse_checkpoint(kind: str, out_dir: Path, *, vocab: Path | None = None) -> Path:
    """A checkpoint folder of the kind whose safetensors file declares every tensor (bfloat16) but
    holds no data: a sparse file of the full length, all zeros, taking no disk. Converters that read
    headers and shapes lazily run over it; its weights are not a model."""
    import json
    import struct

    config, shapes = _meta_shapes(kind)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.to_json_file(out_dir / "config.json")
    if vocab is not None:
        from gemmactl.formats.gguf_vocab import write_hf_tokenizer

        write_hf_tokenizer(vocab, out_dir)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out_dir / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return out_dir


def write_random_gguf(kind: str, out: Path, source_tree: Path, *, vocab: Path) -> Path:
    """A GGUF of the kind straight from random quantized blocks (Q4_K, Q5_0 where rows are not whole
    256-blocks; vectors ones), with the metadata and tensor names the source tree's converter gives
    it: tests/helpers/random_gguf.py over a sparse checkpoint. No bfloat16 copy on disk."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_sparse_checkpoint(kind, Path(folder) / kind, vocab=vocab)
        subprocess.run([sys.executable, str(Path(__file__).with_name("random_gguf.py")), str(source_tree),
                        str(checkpoint), str(out)], check=True, capture_output=True, text=True)
    return Path(out)


def build_tiny_gemma4(kind: str, out_dir: Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Save a random tiny Gemma 4 text model (safetensors + config) into out_dir."""
    return build_random_gemma(kind, out_dir, seed=seed, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description="Save a random-weight Gemma checkpoint shaped like a real one.")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=Path, help="llama.cpp vocabulary GGUF for the tokenizer files")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--int4-stream", action="store_true",
                        help="write an int4-stream artifact directly (random codes), with no checkpoint")
    parser.add_argument("--gguf-from", type=Path, metavar="LLAMA_CPP_SOURCE",
                        help="write a GGUF file OUT directly (random Q4_K blocks) with this source tree's converter metadata")
    parser.add_argument("--sensitive", choices=("int8", "int4"), default="int8",
                        help="with --int4-stream: v_proj and down_proj as int8 rows (default) or int4, as quantize takes it")
    parser.add_argument("--embeddings", choices=("int8", "int4"), default="int8",
                        help="with --int4-stream: the embedding tables as int8 rows (default) or int4")
    parser.add_argument("--head", choices=("tied", "int4"), default="tied",
                        help="with --int4-stream: a tied head read from the table (default) or an int4 copy of its own")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.gguf_from:
        if args.vocab is None:
            parser.error("--gguf-from needs --vocab")
        write_random_gguf(args.kind, args.out, args.gguf_from, vocab=args.vocab)
    elif args.int4_stream:
        write_random_int4(args.kind, args.out, vocab=args.vocab, sensitive=args.sensitive, embeddings=args.embeddings,
                          head=args.head)
    else:
        build_random_gemma(args.kind, args.out, vocab=args.vocab, device=args.device)
    print(f"{args.kind}: saved to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
