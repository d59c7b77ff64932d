"""Attention of a few query rows over a quantized KV cache, reading the codes inside Triton kernels.

A decode step over a quantized cache (kv.py: int8, tq4, tq3) used to decode a block of slots into
bfloat16 keys and values with torch operations, then score them: about ten kernels and 24 bytes of
temporaries per cached element, so at 32K slots tq4 decoded slower than the bfloat16 cache it
shrinks (0.67x on an E4B shape, docs/benchmarks.md). Here the codes are read in place, in two
kernels (kv_attention_kernel.py):

- key_scores: a program to a query row, a KV head and a block of slots takes the keys' 32-bit
  words a run at a time and the codes from them field by field (kv.py stores codes in planes of
  whole fields, so none straddles a word: field f of a word is one shift and a mask for all its
  words), computes their levels (an odd polynomial of the code, kv.py's polynomial_levels: a few
  float operations where a table's lookup took an address and a load each) and multiplies each
  field's with the query's coordinates at that field's places; the scores are scaled by each
  key's scale and masked;
- the softmax over those few rows' scores, in torch (16 bytes a slot for Gemma 4's four query
  heads a KV head, against 516 of a tq4 key and value at 512 coordinates);
- weighted_values: a program to a query row, a KV head, a share of the slots and a run of words
  reads only that run and adds up the values (each scaled) weighted, every field of the run in
  one batched product; the shares are summed after. Both kernels multiply in float16 on tensor
  cores (see _kernel).

Nothing the size of the cache is made but the scores. Only the two kernels' launches are opaque
torch custom ops: in the fused step torch.compile joins the softmax and the sum of the shares to
the operations around them, and the CUDA graph replays it all. Triton is the well-kept route (it
ships with torch's CUDA wheels). Earlier reads, measured on an H100 (docs/benchmarks.md): one
kernel with a running softmax over codes that straddle bytes (about 60 instructions a coordinate,
registers spilled); then the planes, with the values' programs taking four interleaved fields
each and reading every word of a block (4x the values' words). Compiled for sm_90 these kernels
took about 14-19 instructions a coordinate with the level table's lookup, most of them the lookup.
Then the codes were put in coordinate order ([BLOCK, words, F] reshaped), which moved each code
through shared memory and held 156 (keys) and 204 (values) registers a thread; taken field by
field they hold 64 and 137 (Triton's sm_90 build at the default tiles), and on an H100 a global
layer's read at 32K took 14% less time (docs/benchmarks.md).

Every mode is one layout to the kernels: codes of `bits` bits in planes (kv_modes.code_planes),
the four coefficients their levels are computed from, and an fp16 scale per vector. int8 is one
8-bit plane whose level is the byte's signed value. The queries come in turned by the cache's
rotation and the output leaves in that space: the caller adds the values' centre and turns it
back (model.py, as for the torch read).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from gemmactl.runtime.engine.gemv_common import available
from gemmactl.runtime.engine.gemv_common import sms as _sms
from gemmactl.runtime.engine.gemv_common import tile_setting
from gemmactl.runtime.engine.kv_modes import FUSED_ROWS_MAX, code_planes

ENV = "GEMMACTL_KV_KERNEL"  # auto (on for CUDA with Triton) | off (the torch read) | on (also Triton's CPU interpreter)
# Query rows (tokens) a call takes, fewer at long context (kv_modes.fused_rows); longer prefill
# chunks read by blocks.
ROWS_MAX = FUSED_ROWS_MAX
# Tiles (slots x coordinates) of the two kernels: the key scores' programs take a block of slots and
# every coordinate a run of words at a time; the values' programs a share of the slots a block at a
# time and one run of words. A run is CHUNK coordinates' words, 16 at least (tl.dot needs 16 each
# way). The values' blocks are 32 slots: a 2-bit plane's 16 fields make a block's codes
# [16, BLOCK, 16], which spill at 64. Chosen by an H100's sweep (docs/benchmarks.md).
SCORE_BLOCK, SCORE_CHUNK = 32, 128
VALUE_BLOCK, VALUE_CHUNK = 32, 128
PROGRAMS_PER_SM = 4  # the values' programs: enough to keep each multiprocessor's loads in flight
WARPS = 4
TILE_ENV = "GEMMACTL_KV_READ_TILE"  # forces the read's tiles (benchmarks/kv_read_gpu.py --tiles sweeps them)


class ReadTile(NamedTuple):
    score_block: int  # slots a key-score program takes
    score_chunk: int  # coordinates it takes at a time (their words: 16 at least)
    value_block: int  # slots a value program takes at a time
    value_chunk: int  # coordinates a value program's run of words holds (16 words at least)
    warps: int
    programs_per_sm: int = PROGRAMS_PER_SM  # value programs a multiprocessor gets (shares_for)


DEFAULT_READ_TILE = ReadTile(SCORE_BLOCK, SCORE_CHUNK, VALUE_BLOCK, VALUE_CHUNK, WARPS)
# A read of a short cache (1,024 slots or fewer: a sliding layer's window) takes blocks of 16 slots,
# twice the programs for its few hundred slots. Read alone on an H100 (E4B's shape, 256 wide, tq4),
# a window of 512 slots took 0.0144 ms against 0.0155 at 32-slot blocks, one of 1,024 0.0153
# against 0.0178 (docs/benchmarks.md); a 32K cache (512 wide) 0.121 at 16-slot blocks against 0.105
# (results/kv_read_gpu-e4b-global-forms-h100-gpu.json).
SHORT_SLOTS = 1024
SHORT_READ_TILE = ReadTile(16, SCORE_CHUNK, 16, VALUE_CHUNK, WARPS)
_TILE_FIELDS = "SCORE_BLOCK,SCORE_CHUNK,VALUE_BLOCK,VALUE_CHUNK,WARPS[,PROGRAMS_PER_SM]"


def tile_for(slots) -> ReadTile:
    """The read's tiles for a read of slots slots (read_tile's, short up to SHORT_SLOTS)."""
    return read_tile(bool(slots <= SHORT_SLOTS))


@functools.cache
def read_tile(short: bool = False) -> ReadTile:
    """The read's tiles: TILE_ENV's where set (for every read, short or long), else SHORT_READ_TILE
    for a short read and DEFAULT_READ_TILE for a longer one. Cached; a compiled step reads it where
    it is traced, and its ops take the tiles as arguments (below)."""
    forced = tile_setting(TILE_ENV, ReadTile, _TILE_FIELDS, "32,128,32,128,4")
    if forced is None:
        return SHORT_READ_TILE if short else DEFAULT_READ_TILE
    sizes = (forced.score_block, forced.score_chunk, forced.value_block, forced.value_chunk, forced.warps)
    if min(sizes[:4]) < 16 or min(forced.score_chunk, forced.value_chunk) < 32 \
            or not all(v & (v - 1) == 0 for v in sizes):
        raise ValueError(f"{TILE_ENV}={','.join(map(str, forced))}: expected {_TILE_FIELDS}, powers of two, "
                         "blocks 16 and chunks 32 at least; unset it for the engine's own tiles")
    return forced


MIN_SLOTS_ENV = "GEMMACTL_KV_KERNEL_MIN_SLOTS"  # caches shorter than this are read by torch (default 0: none)


def shape_fits(head_dim: int) -> bool:
    """Whether the kernels take vectors of head_dim coordinates: a power of two, 32 at least (each
    plane whole words, and a run of words a power of two wide, as tl.arange takes: 96 coordinates
    of int8 would be a run of 24)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def usable(device, rows: int, head_dim: int, slots: int | None = None) -> bool:
    """Whether the fused read takes rows query rows of head_dim (over slots slots) on device: CUDA
    with Triton (unless ENV is off), or Triton's CPU interpreter when ENV is on (the tests' way to
    run it). MIN_SLOTS_ENV leaves short caches (a sliding layer's window) to the torch read, which
    a fused step compiles with its neighbours; measured, that was slower: an E4B step at 32K on an
    H100 ran 185 tok/s with the sliding windows read by torch, 206 with every read here."""
    setting = os.environ.get(ENV, "auto")
    if setting == "off" or rows > ROWS_MAX or not shape_fits(head_dim):
        return False
    if slots is not None and slots < int(os.environ.get(MIN_SLOTS_ENV, "0")):
        return False
    if torch.device(device).type == "cuda":
        return available(device)
    if setting != "on" or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """Triton, the kernels, and the dtype their tl.dot takes: float16, whose three more bits of
    mantissa than bfloat16 keep a read's products about 8x closer to float32's (on an H100 a
    read in bfloat16 was up to 2% of its output off the torch read of the same cache, in float16
    0.3%). Nothing the read multiplies comes near float16's range: the levels are
    at most 127 (int8) or a few units (the turbo modes), the weights at most 1, the queries
    normalized, and a value's scale is applied before its cast. The interpreter takes the same."""
    import triton
    import triton.language as tl

    from gemmactl.runtime.engine import kv_attention_kernel as kernels

    return triton, kernels, tl.float16


def shares_for(slots: int, programs: int, device: torch.device, tile: ReadTile) -> tuple[int, int]:
    """(shares, slots per share) for `programs` programs a share over slots: enough shares that the
    GPU's multiprocessors each get the tile's programs_per_sm programs (PROGRAMS_PER_SM by default),
    a whole number of its value blocks each."""
    blocks = -(-slots // tile.value_block)
    shares = max(1, min(blocks, -(-tile.programs_per_sm * _sms(device) // max(programs, 1))))
    per = -(-blocks // shares) * tile.value_block
    return -(-slots // per), per


def value_runs(dim: int, w0: int, chunk: int) -> int:
    """Programs the values' read takes a vector of dim coordinates in: runs of main-plane words
    (w0 bits a field), chunk coordinates' words each, 16 words at least (the kernels' CW)."""
    fields = 32 // w0
    words = max(16, chunk // fields)
    return -(-(dim // fields) // words)


def _group_block(groups: int) -> int:
    """Query heads a program holds: the groups padded to a power of two, 16 at least (tl.dot)."""
    return max(16, 1 << (groups - 1).bit_length())


# Only the kernels' launches are opaque ops: a compiled step fuses the softmax between them and the
# sum of the shares after with the operations around them, rather than launching each alone. The
# tiles and the values' shares are the ops' arguments, chosen where the step is traced: so they are
# constants of the compiled graph, and a graph compiled (and cached on disk) at other tiles, whose
# shares are another number, is not taken for it.
@torch.library.custom_op("gemmactl::quantized_key_scores", mutates_args=())
def quantized_key_scores(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_levels: torch.Tensor,
                         key_positions: torch.Tensor, positions: torch.Tensor, k_bits: int, query_scale: float,
                         window: int, tile: list[int]) -> torch.Tensor:
    """Scores [T·K, g, S] (float32) of query rows q [T, K, g, D], unseen slots at -3e38."""
    triton, kernels, dot = _kernel()
    t, kv_heads, groups, dim = q.shape
    slots = k_codes.shape[0]
    k0, k1 = code_planes(k_bits)
    scores = torch.empty((t * kv_heads, groups, slots), dtype=torch.float32, device=q.device)
    tile = ReadTile(*tile)
    kernels.key_scores[(t * kv_heads, triton.cdiv(slots, tile.score_block))](
        q.contiguous(), k_codes.view(torch.int32), k_scales, k_levels, key_positions, positions, scores, slots,
        kv_heads, groups, k_codes.shape[-1] // 4, query_scale, window, D=dim, W0=k0, W1=k1,
        GROUPS=_group_block(groups), BLOCK=tile.score_block, CHUNK=min(tile.score_chunk, dim), DOT=dot,
        num_warps=tile.warps)
    return scores


@quantized_key_scores.register_fake
def _(q, k_codes, k_scales, k_levels, key_positions, positions, k_bits, query_scale, window, tile):
    t, kv_heads, groups, _ = q.shape
    return q.new_empty((t * kv_heads, groups, k_codes.shape[0]), dtype=torch.float32)


@torch.library.custom_op("gemmactl::quantized_weighted_values", mutates_args=())
def quantized_weighted_values(weights: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor,
                              v_levels: torch.Tensor, kv_heads: int, v_bits: int, tile: list[int], shares: int,
                              per: int) -> torch.Tensor:
    """Each share's weighted values [T·K, shares, g, D] (float32) for weights [T·K, g, S]: shares
    of per slots each (shares_for)."""
    triton, kernels, dot = _kernel()
    rows, groups, slots = weights.shape
    dim = v_codes.shape[-1] * 8 // v_bits
    v0, v1 = code_planes(v_bits)
    tile = ReadTile(*tile)
    chunk = min(tile.value_chunk, dim)
    runs = value_runs(dim, v0, chunk)
    parts = torch.empty((rows, shares, groups, dim), dtype=torch.float32, device=weights.device)
    kernels.weighted_values[(rows, shares, runs)](
        weights.contiguous(), v_codes.view(torch.int32), v_scales, v_levels, parts, slots, kv_heads, groups,
        v_codes.shape[-1] // 4, per, shares, D=dim, W0=v0, W1=v1, GROUPS=_group_block(groups),
        BLOCK=tile.value_block, CHUNK=chunk, DOT=dot, num_warps=tile.warps)
    return parts


@quantized_weighted_values.register_fake
def _(weights, v_codes, v_scales, v_levels, kv_heads, v_bits, tile, shares, per):
    rows, groups, slots = weights.shape
    return weights.new_empty((rows, shares, groups, v_codes.shape[-1] * 8 // v_bits), dtype=torch.float32)


def quantized_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_levels: torch.Tensor,
                        v_codes: torch.Tensor, v_scales: torch.Tensor, v_levels: torch.Tensor,
                        key_positions: torch.Tensor, positions: torch.Tensor, k_bits: int, v_bits: int,
                        query_scale: float, window: int) -> torch.Tensor:
    """softmax(q·k · query_scale, masked) v for query rows q [T, K, g, D] (turned as the cache
    turns its vectors) at positions [T] over a cache of S slots: codes [S, K, D·bits/8] (uint8),
    scales [S, K] (fp16), the levels' coefficients [4] (float32: mid, c1, c3, c5),
    key_positions [S] (-1: unwritten). A key is
    seen when written, at or before the row's position, and within window (0: no window).
    Returns [T, K, g, D] in float32."""
    t, kv_heads, groups, dim = q.shape
    if not shape_fits(dim):  # a run of words is a tl.arange: a power of two wide (shape_fits)
        raise ValueError(f"the fused KV read takes head dims that are powers of two from 32, not {dim}")
    slots = k_codes.shape[0]
    tile = tile_for(slots)
    scores = quantized_key_scores(q, k_codes, k_scales, k_levels, key_positions, positions, k_bits, query_scale,
                                  window, list(tile))
    # The softmax over a few rows' scores (16 bytes a slot and KV head for Gemma 4's 4 query heads a
    # KV head, against 516 of a tq4 key and value of 512 coordinates), normalized, so the values'
    # shares only add up.
    weights = torch.softmax(scores, dim=-1)
    runs = value_runs(dim, code_planes(v_bits)[0], min(tile.value_chunk, dim))
    shares, per = shares_for(slots, t * kv_heads * runs, q.device, tile)
    parts = quantized_weighted_values(weights, v_codes, v_scales, v_levels, kv_heads, v_bits, list(tile), shares, per)
    return parts.sum(1).reshape(t, kv_heads, groups, dim)
