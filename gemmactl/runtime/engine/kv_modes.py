"""KV cache modes: their names and sizes (no torch here: the planner and the CLI read these).

- bf16: keys and values as computed (the engine's compute dtype); the default.
- int8: each key and value vector (one head, one position) as int8 with an fp16 scale.
- tq4, tq3: TurboQuant-style (arXiv 2504.19874, its MSE variant): each vector is turned by a
  fixed random rotation (a Hadamard matrix with random signs), which makes its coordinates
  near-Gaussian, then every coordinate is quantized on its own to the levels of the Lloyd-Max
  quantizer for a Gaussian, scaled by the vector's RMS (fp16). 4 or 3 bits a coordinate on
  average, keys taking one more and values one less (TURBO_BITS), plus 16 bits a vector.

A mode may name the sliding layers' windows apart, GLOBAL/WINDOWS: `tq4/bf16` quantizes the
global layers' caches, which grow with the context, and keeps the windows (a fixed few hundred
slots each) in bfloat16. A window in tq4 saves little memory (about 16 MB for all of an E4B shape's
at any context), costs a decode step its write, its rotation and a read kernel per layer, and
carried most of tq4's error on the real Gemma 3 270M at 8K (perplexity +9.4% with the windows in
tq4, +1.0% with them in bf16; docs/benchmarks.md). A plain mode is every layer's.

The llama.cpp tiers take their own cache types from the same recipe field (f16, q8_0, q4_0:
llama.cpp's -ctk/-ctv, with flash attention for a quantized V); llama.cpp has one type for all
layers.
"""

from __future__ import annotations

ENGINE_MODES = ("bf16", "int8", "tq4", "tq3")
LLAMACPP_MODES = ("f16", "q8_0", "q4_0")
DEFAULT_MODE = "bf16"
WINDOWS_SEP = "/"  # GLOBAL/WINDOWS: the sliding layers' own mode
SLIDING_KIND = "sliding_attention"  # runtime/engine/spec.SLIDING (no torch here)
# Bits a coordinate of a key and of a value. Keys carry the error that matters: on the real Gemma 3
# 270M at 8K tokens, 4 bits for both with exact keys moved perplexity +0.7%, with exact values
# +17.3%; keys 5 and values 3 (the same bytes) about +9.5%, keys 6 and values 2 +28%.
TURBO_BITS = {"tq4": (5, 3), "tq3": (4, 2)}
_BITS = {"int8": (8, 8), **TURBO_BITS}
# llama.cpp's cache types, bytes a value: f16, and ggml's blocks of 32 values (q8_0: 32 int8 and an
# f16 scale; q4_0: 16 bytes of nibbles and an f16 scale).
LLAMACPP_VALUE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


# Attention reads a quantized cache a block of slots at a time (runtime/engine/model.py: the block's
# keys and values decoded, its scores folded into a running softmax), so neither the decoded cache
# nor the decoding's temporaries (codes as int64 indices, their levels and the scaled levels in
# float32: 16 bytes an element) are ever held whole. A block's temporaries stay under
# READ_BLOCK_BYTES. Decoded whole, one read of an E4B-shaped global layer at 32K (2 heads of 512)
# held about 400 MB, which broke a 4 GiB budget, and the decoded keys and values alone cost as much
# device memory per token as tq4 saved.
READ_TEMP_BYTES = 24  # 16 counted as above, and keys at 5 bits unpack through int64 words of 8 codes
READ_BLOCK_BYTES = 32 << 20
FUSED_ROWS_MAX = 16  # query rows the fused read takes at once (kv_attention.ROWS_MAX)
FUSED_SCORE_BYTES = 8  # the fused read's float32 score and softmax weight, a slot, row and query head


def read_block_slots(kv_heads: int, head_dim: int) -> int:
    """Slots a quantized cache decodes at once."""
    return max(1, READ_BLOCK_BYTES // max(kv_heads * head_dim * READ_TEMP_BYTES, 1))


def fused_rows(rows: int, heads: int, slots: int) -> int:
    """Query rows the fused read takes over slots at once: up to FUSED_ROWS_MAX while their scores
    and weights (every slot's, FUSED_SCORE_BYTES each) stay within a read block's room, one row
    always (a decode step). More rows than this read by blocks (runtime/engine/model.py). Without
    the bound a prompt's last few tokens at 128K held 128 MiB of scores for an E4B-shaped global
    layer (16 rows), where the read by blocks holds about 67 MiB: the plan kept the larger room,
    about 15,000 tq4 tokens of that shape's cache."""
    fit = READ_BLOCK_BYTES // max(FUSED_SCORE_BYTES * heads * slots, 1)
    return max(1, min(rows, FUSED_ROWS_MAX, fit))


def read_bytes(mode: str | None, slots: int, heads: int, kv_heads: int, head_dim: int, rows: int,
               dtype_bytes: int = 2) -> int:
    """Device bytes one attention read of a layer's cache by `rows` query rows holds besides the
    cache: none for bf16 (views of its buffers); for the quantized modes one block's keys and
    values decoded and their temporaries, its scores (8 bytes each, as spec.SCORE_BYTES) and the
    running softmax's float32 sums."""
    if (mode or DEFAULT_MODE) == "bf16":
        return 0
    block = min(slots, read_block_slots(kv_heads, head_dim))
    by_blocks = (block * kv_heads * head_dim * (2 * dtype_bytes + READ_TEMP_BYTES) + rows * heads * block * 8
                 + rows * heads * (head_dim + 2) * 4 * 2)
    # The fused read of a decode or verify step (kv_attention.py) holds every slot's float32 score
    # of its few rows and their softmax: 8 MiB at one row for an E4B-shaped global layer at 128K;
    # more rows only while they fit a block's room (fused_rows).
    fused = FUSED_SCORE_BYTES * fused_rows(rows, heads, slots) * heads * slots
    return max(by_blocks, fused)


def code_planes(bits: int) -> tuple[int, int]:
    """How a vector's codes of `bits` bits are stored (kv.py): a main plane of W0 bits a code and,
    where bits is not a power of two, a second plane of the remaining W1 (0: none), each a little-
    endian stream of fields that never straddles a 32-bit word: 5 bits as 4 + 1, 3 as 2 + 1."""
    planes = {8: (8, 0), 6: (4, 2), 5: (4, 1), 4: (4, 0), 3: (2, 1), 2: (2, 0), 1: (1, 0)}
    if bits not in planes:
        raise ValueError(f"codes of {bits} bits have no layout here (1 to 6, or 8)")
    return planes[bits]


def pair_bytes(mode: str, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes a key and a value vector of head_dim coordinates take together in the engine's cache."""
    if mode == "bf16":
        return 2 * head_dim * dtype_bytes
    return sum((head_dim * bits + 7) // 8 + 2 for bits in _BITS[mode])  # packed codes and an fp16 scale each


def compression(mode: str, head_dim: int) -> float:
    """How many times smaller than bfloat16 the mode keeps a key and a value."""
    return head_dim * 4 / pair_bytes(mode, head_dim)


def layer_mode(mode: str | None, kind: str) -> str:
    """The mode of one layer's cache: a GLOBAL/WINDOWS mode's WINDOWS for a sliding layer (kind:
    runtime/engine/spec's SLIDING or FULL), its GLOBAL otherwise; a plain mode everywhere."""
    mode = mode or DEFAULT_MODE
    if WINDOWS_SEP not in mode:
        return mode
    first, windows = mode.split(WINDOWS_SEP, 1)
    return windows if kind == SLIDING_KIND else first


def mode_problem(mode: str, backend: str) -> str | None:
    """Why mode is not a KV cache mode of backend ("int4" engine or "llamacpp"), or None."""
    if backend != "int4":
        if WINDOWS_SEP in mode:
            return f"llama.cpp takes one KV cache type for every layer, not {mode!r}"
        return None if mode in LLAMACPP_MODES else f"{mode!r} is not a KV cache mode of llama.cpp"
    parts = mode.split(WINDOWS_SEP)
    if len(parts) > 2 or not all(part in ENGINE_MODES for part in parts):
        return f"{mode!r} is not a KV cache mode of the int4 engine"
    return None


def modes_hint(backend: str) -> str:
    """The modes a backend takes, as a hint's sentence."""
    if backend != "int4":
        return f"Use one of: {', '.join(LLAMACPP_MODES)}."
    return (f"Use one of: {', '.join(ENGINE_MODES)}, or GLOBAL{WINDOWS_SEP}WINDOWS for the sliding layers' "
            f"own (e.g. tq4{WINDOWS_SEP}bf16).")


def check_mode(mode: str | None, backend: str, *, option: str = "--kv-cache") -> str | None:
    """The mode for a backend ("int4" engine or "llamacpp"), or a one-line error listing the modes."""
    from gemmactl.errors import InvalidOptionError

    if mode is None:
        return None
    problem = mode_problem(mode, backend)
    if problem:
        raise InvalidOptionError(f"{option}: {problem}", hint=modes_hint(backend))
    return mode
