"""One token times an int8-row matrix on CUDA, in a Triton kernel that reads each code once.

A decode step multiplies one token by each weight, so it is bound by the bytes it reads. Rows kept
as int8 read half the bytes of their bfloat16 copies, if the kernel reads the codes as they are:
torch's CUDA `_weight_int8pack_mm` loops over K in one thread per output (59 tok/s on the E2B
shape), and torch.compile's fusion of a multiply and a row sum ran the step at 288 tok/s against
344 for bfloat16 copies in cuBLAS (docs/benchmarks.md). This kernel is the plain GEMV: each
program owns a block of rows, walks K in tiles, and accumulates in float32; Triton is the
well-kept route to it (it ships with torch's CUDA wheels). Its tiles were measured shape by shape
on the H200 (benchmarks/int8_gemv_sweep.py) and are fixed by shape here, with K split for
matrices with few rows, rather than left to Triton's autotuner: autotuning times each candidate
with a 256 MB cache-flush buffer on the GPU, which would break the plan's memory budget at the
first step of every shape. It is a torch custom op, so torch.compile keeps it whole in the fused
step and the CUDA graph replays it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from gemmactl.runtime.engine.gemv_common import available, dot_dtype, split_k, tile_setting  # noqa: F401 (available: kernels.py)
from gemmactl.runtime.engine.gemv_common import sms as _sms

TILE_ENV = "GEMMACTL_INT8_TILE"  # "ROWS,COLS,WARPS[,PROGRAMS]": one tile for every shape, to measure one


class Tile(NamedTuple):
    rows: int  # BLOCK_N: rows a program owns
    cols: int  # BLOCK_K: columns it reads per iteration
    warps: int
    programs_per_sm: int = 4  # fewer row blocks than this per multiprocessor: K is split to make more


# Chosen by benchmarks/int8_gemv_sweep.py on the H200 over E2B's int8 matrices (docs/benchmarks.md).
# A tall matrix (the 262,144-row head) has programs to spare and reads fastest in small tiles:
# 131 µs (3.1 TB/s) against 150 for 16×256 and 191 for cuBLAS on its bfloat16 copy. A short, wide
# one (down_proj, 1,536 rows by 6,144 or 12,288) wants two long rows a program: 6.3 and 10.2 µs
# against 11.2 and 15.7 for 16×256 with K split, and 10.2 and 15.9 for cuBLAS in bfloat16.
TALL_ROWS = 16_384
TALL_TILE = Tile(8, 256, 2)
WIDE_TILE = Tile(2, 2048, 4)


@functools.cache
def tile_for(out_features: int, in_features: int) -> Tile:
    """The tile for a matrix: TILE_ENV when set (to measure one), else by its shape."""
    forced = tile_setting(TILE_ENV, Tile, "ROWS,COLS,WARPS[,PROGRAMS]", "8,256,2")
    if forced is not None:
        return forced
    return TALL_TILE if out_features >= TALL_ROWS else WIDE_TILE


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_rows_gemv(x_ptr, q_ptr, s_ptr, y_ptr, N, K, stride_x, stride_q, K_PER,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        token = tl.program_id(0)  # one token a program: a row's arithmetic never depends on the others
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = rows < N
        first = tl.program_id(2) * K_PER  # this program's share of K (split-K for short matrices)
        # Products accumulate element-wise and are summed across the tile once, at the end: a
        # reduction per iteration would put a cross-thread sum between every two loads.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for offset in range(0, K_PER, BLOCK_K):
            cols = first + offset + tl.arange(0, BLOCK_K)  # [BK]
            col_ok = cols < K  # K_PER is a whole number of tiles
            x = tl.load(x_ptr + token * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BK]
            q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)  # [BN, BK]
            acc += q * x[None, :]
        scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=1)
        out = y_ptr + (tl.program_id(2) * tl.num_programs(0) + token) * N + rows
        tl.store(out, (total * scale).to(y_ptr.dtype.element_ty), mask=row_ok)

    return triton, int8_rows_gemv


@functools.cache
def split(out_features: int, in_features: int, sms: int, tile: Tile | None = None) -> tuple[int, int]:
    """(splits, columns per split): a matrix with too few row blocks to give every multiprocessor
    the tile's programs (v_proj, down_proj) splits K, and its partial sums are added after."""
    tile = tile or tile_for(out_features, in_features)
    return split_k(out_features, tile.rows, in_features, tile.cols, sms, tile.programs_per_sm)


@torch.library.custom_op("gemmactl::int8_rows_gemv", mutates_args=())
def int8_rows_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [in] (one token) or [T, in] (T ≤ FEW_TOKENS_MAX) · (qweight [out, in] int8 × scales [out])
    → [out] or [T, out] in x's dtype.

    Several tokens are the GEMV once per token, side by side in one launch (the token is the
    grid's fastest axis, so the programs that read a tile of the matrix run together and its
    second reads come from L2): each token's products and sums are the one-token kernel's, in the
    same order, so a verify step's row equals the decode step's bit for bit. A tl.dot kernel over
    the tokens together (as this module had) rounds a row otherwise than the GEMV does: on an
    H100, an E4B shape's down_proj and head moved by up to 0.2% of a row's largest value, and
    greedy speculation parted from plain decoding (benchmarks/batch_invariance.py)."""
    triton, kernel = _kernel()
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    tokens = flat.shape[0]
    out_features, in_features = qweight.shape
    tile = tile_for(out_features, in_features)
    splits, per = split(out_features, in_features, _sms(x.device), tile)
    dtype = x.dtype if splits == 1 else torch.float32
    y = torch.empty((splits, tokens, out_features), dtype=dtype, device=x.device)
    kernel[(tokens, triton.cdiv(out_features, tile.rows), splits)](flat, qweight, scales, y, out_features, in_features,
                                                                   flat.stride(0), qweight.stride(0), per,
                                                                   BLOCK_N=tile.rows, BLOCK_K=tile.cols,
                                                                   num_warps=tile.warps)
    total = y[0]
    for part in y[1:]:  # the partial sums in split order, whatever the tokens
        total = total + part
    total = total.to(x.dtype)
    return total.reshape(*x.shape[:-1], out_features)


@int8_rows_gemv.register_fake
def _(x, qweight, scales):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# A verify step's few tokens (the pending token and k drafts) take the GEMV per token in one launch;
# more (a prefill chunk) decode a block of rows at a time into cuBLAS.
FEW_TOKENS_MAX = 16
