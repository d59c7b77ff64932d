"""A decode step's write to a turbo KV cache and its queries' turn, in one Triton kernel.

A TurboKVCache (kv.py) turns every key and value by a rotation before it quantizes them, and the
fused read (kv_attention.py) takes the queries turned the same way. Written in torch, one layer's
write in a decode step took about thirteen launches after torch.compile's fusion: the turn of the
keys and of the values (float32 products, each a cuBLAS kernel and its split-K reduction), the
scales and the bucketing, the packing of each plane, the index copies; and the queries' turn one
more. Each is a few microseconds for a few vectors, so on an E4B shape at 32K they were about
650 of the 4,900 microseconds of a step (docs/benchmarks.md). Here the queries, keys and values of
the step's tokens are turned, quantized, packed and stored, and their positions with them, by one
launch (kv_turn_kernel.py).

The rotation is a Hadamard matrix after random signs (kv.hadamard_rotation): the kernel takes the
signs and the ±1 matrix, which float16 holds exactly, and turns a vector by two float16 products on
tensor cores (its float16 part and what that leaves), which keeps about 22 bits of its mantissa
against float32's 24. A vector's scale is its RMS, which the rotation keeps, so every program of a
chunk of coordinates has it without the others. The codes equal the torch write's but where the
products' rounding moves a coordinate across a level's edge (kv.py's write stays the reference:
prefill, and caches this kernel does not take). A coordinate beyond float16's range (65,504, less
its centre) would not turn; the norms before the write keep them far below it. Triton is the
well-kept route here as for the read: it ships with torch's CUDA wheels and compiles the same
source for the tests' CPU interpreter.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from gemmactl.runtime.engine import kv_attention
from gemmactl.runtime.engine.gemv_common import tile_setting
from gemmactl.runtime.engine.kv_modes import FUSED_ROWS_MAX, code_planes

ROWS = 16  # vectors a program takes (tl.dot's least)
TILE_ENV = "GEMMACTL_KV_TURN_TILE"  # "CHUNK,PART,WARPS[,STAGES]": another tile, to measure it


class Tile(NamedTuple):
    chunk: int  # coordinates of the turned vectors a program computes
    part: int  # coordinates of the contraction a product takes at a time
    warps: int
    stages: int = 3  # parts of the contraction in flight (Triton's software pipelining)


# benchmarks/kv_turn_gpu.py on an H100 (E4B's shapes, 256 and 512 wide, one token, the write
# captured with what it stores): 32 coordinates a program, 64 of the contraction a part, 4 warps, 3
# parts in flight, was the best of nine tiles: 8.1 and 11.7 µs a write, where the kernel's earlier
# form (every part's loads unrolled, 255 registers a thread and spilling in Triton's sm_90 build,
# the positions stored by an index copy after it) took 10.2 and 16.0. 8 warps took 11-20 µs.
DEFAULT_TILE = Tile(32, 64, 4, 3)


@functools.cache
def tile() -> Tile:
    forced = tile_setting(TILE_ENV, Tile, "CHUNK,PART,WARPS[,STAGES]", "32,64,4,3")
    if forced is not None and min(forced.chunk, forced.part) < 16:  # tl.dot's least each way
        raise ValueError(f"{TILE_ENV}={','.join(map(str, forced))}: CHUNK and PART take 16 at "
                         "least; unset it for the engine's own tile")
    return DEFAULT_TILE if forced is None else forced


def usable(device, rows: int, head_dim: int) -> bool:
    """Whether the kernel writes rows tokens of head_dim on device: where the fused read reads them."""
    return rows <= FUSED_ROWS_MAX and kv_attention.usable(device, rows, head_dim)


@functools.cache
def hadamard(dim: int, device: str) -> torch.Tensor:
    """The ±1 Hadamard matrix [dim, dim] (dim a power of two) in float16, one per size and device."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h.to(device=device, dtype=torch.float16)


@torch.library.custom_op("gemmactl::turned_write",
                         mutates_args=("k_codes", "k_scales", "v_codes", "v_scales", "pos"))
def turned_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_centre: torch.Tensor, v_centre: torch.Tensor,
                 signs: torch.Tensor, k_edges: torch.Tensor, v_edges: torch.Tensor, k_codes: torch.Tensor,
                 k_scales: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, pos: torch.Tensor, k_bits: int, v_bits: int) -> torch.Tensor:
    """Store k, v [T, K, D] less their centres [K, D], turned and quantized, at slots [T] of the
    codes [S, K, D·bits/8] (uint8) and scales [S, K] (fp16), and the tokens' positions [T] at the same
    slots of pos [S]; return q [T, N, D] turned (float32)."""
    import triton

    from gemmactl.runtime.engine import kv_turn_kernel

    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not q.dtype == k.dtype == v.dtype:  # the kernel takes one pointer a row, of one type
        raise ValueError(f"the turned write takes q, k and v of one dtype, not {q.dtype}, {k.dtype}, {v.dtype}")
    k0, k1 = code_planes(k_bits)
    v0, v1 = code_planes(v_bits)
    out = torch.empty((t, heads, dim), dtype=torch.float32, device=q.device)
    rows = t * (heads + 2 * kv_heads)
    chunk, part, warps, stages = tile()
    chunk, part = min(chunk, dim), min(part, dim)
    kv_turn_kernel.turned_write[(triton.cdiv(rows, ROWS), dim // chunk)](
        q.contiguous(), k.contiguous(), v.contiguous(), k_centre, v_centre, signs, hadamard(dim, str(q.device)),
        k_edges, v_edges, k_codes, v_codes, k_scales, v_scales, slots.contiguous(), positions.contiguous(), pos, out,
        rows, heads, kv_heads, k_codes.shape[0], 1.0 / math.sqrt(dim), D=dim, ROWS=ROWS, CHUNK=chunk, PART=part,
        KW0=k0, KW1=k1, VW0=v0, VW1=v1, K_EDGES=k_edges.shape[0], V_EDGES=v_edges.shape[0], STAGES=stages,
        num_warps=warps)
    return out


@turned_write.register_fake
def _(q, k, v, k_centre, v_centre, signs, k_edges, v_edges, k_codes, k_scales, v_codes, v_scales, slots, positions,
      pos, k_bits, v_bits):
    return q.new_empty(q.shape, dtype=torch.float32)
