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
    def int8_rows_gemv(x_ptr, q_ptr, s_ptr, y_ptr, N, K, stride_q, K_PER,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = rows < N
        first = tl.program_id(1) * K_PER  # this program's share of K (split-K for short matrices)
        # Products accumulate element-wise and are summed across the tile once, at the end: a
        # reduction per iteration would put a cross-thread sum between every two loads.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for offset in range(0, K_PER, BLOCK_K):
            cols = first + offset + tl.arange(0, BLOCK_K)  # [BK]
            col_ok = cols < K  # K_PER is a whole number of tiles
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BK]
            q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)  # [BN, BK]
            acc += q * x[None, :]
        scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=1)
        tl.store(y_ptr + tl.program_id(1) * N + rows, (total * scale).to(y_ptr.dtype.element_ty), mask=row_ok)

    return triton, int8_rows_gemv


@functools.cache
def split(out_features: int, in_features: int, sms: int, tile: Tile | None = None) -> tuple[int, int]:
    """(splits, columns per split): a matrix with too few row blocks to give every multiprocessor
    the tile's programs (v_proj, down_proj) splits K, and its partial sums are added after."""
    tile = tile or tile_for(out_features, in_features)
    return split_k(out_features, tile.rows, in_features, tile.cols, sms, tile.programs_per_sm)


@torch.library.custom_op("gemmactl::int8_rows_gemv", mutates_args=())
def int8_rows_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [in] (one token) · (qweight [out, in] int8 × scales [out]) → [out] in x's dtype."""
    triton, kernel = _kernel()
    out_features, in_features = qweight.shape
    tile = tile_for(out_features, in_features)
    splits, per = split(out_features, in_features, _sms(x.device), tile)
    if splits == 1:
        y = torch.empty(out_features, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((splits, out_features), dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(out_features, tile.rows), splits)](x.contiguous(), qweight, scales, y, out_features,
                                                           in_features, qweight.stride(0), per, BLOCK_N=tile.rows,
                                                           BLOCK_K=tile.cols, num_warps=tile.warps)
    return y if splits == 1 else y.sum(0).to(x.dtype)


@int8_rows_gemv.register_fake
def _(x, qweight, scales):
    return x.new_empty(qweight.shape[0])


# A few tokens at once (speculation's verify step: the pending token and k drafts). The block path
# decodes every row to bfloat16 and hands cuBLAS the copy, reading the matrix three times over;
# this kernel reads each code once for all the tokens, with Triton's tl.dot on tiles of at least
# 16 (the tokens are padded to 16 inside the kernel, never in memory). Not tuned shape by shape as
# the one-token tiles were: one tile, K split for matrices with few row blocks.
FEW_TOKENS_MAX = 16
FEW_TILE = Tile(32, 128, 4)


@functools.cache
def _few_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_rows_few(x_ptr, q_ptr, s_ptr, y_ptr, T, N, K, stride_x, stride_q, K_PER,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        toks = tl.arange(0, BLOCK_T)  # [BT]
        row_ok, tok_ok = rows < N, toks < T
        first = tl.program_id(1) * K_PER
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for offset in range(0, K_PER, BLOCK_K):
            cols = first + offset + tl.arange(0, BLOCK_K)  # [BK]
            col_ok = cols < K
            x = tl.load(x_ptr + toks[:, None] * stride_x + cols[None, :],
                        mask=tok_ok[:, None] & col_ok[None, :], other=0.0).to(DOT)  # [BT, BK]
            q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0).to(DOT)  # [BN, BK], exact
            acc += tl.dot(x, tl.trans(q))  # [BT, BN], float32
        scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = y_ptr + tl.program_id(1) * T * N + toks[:, None] * N + rows[None, :]
        tl.store(out, (acc * scale[None, :]).to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])

    return triton, int8_rows_few


@torch.library.custom_op("gemmactl::int8_rows_few", mutates_args=())
def int8_rows_few(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] (2 ≤ T ≤ FEW_TOKENS_MAX tokens) · (qweight [out, in] int8 × scales [out]) → [T, out]
    in x's dtype. The tokens enter tl.dot in bfloat16 (as the compute dtype holds them)."""
    triton, kernel = _few_kernel()
    tokens = x.shape[0]
    out_features, in_features = qweight.shape
    tile = FEW_TILE
    splits, per = split(out_features, in_features, _sms(x.device), tile)
    x = x.contiguous()
    dtype = x.dtype if splits == 1 else torch.float32
    y = torch.empty((splits, tokens, out_features), dtype=dtype, device=x.device)
    kernel[(triton.cdiv(out_features, tile.rows), splits)](x, qweight, scales, y, tokens, out_features, in_features,
                                                           x.stride(0), qweight.stride(0), per, BLOCK_T=16,
                                                           BLOCK_N=tile.rows, BLOCK_K=tile.cols, DOT=dot_dtype(),
                                                           num_warps=tile.warps)
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)


@int8_rows_few.register_fake
def _(x, qweight, scales):
    return x.new_empty((x.shape[0], qweight.shape[0]))
