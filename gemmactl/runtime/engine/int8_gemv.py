"""One token times an int8-row matrix on CUDA, in a Triton kernel that reads each code once.

A decode step multiplies one token by each weight, so it is bound by the bytes it reads. Rows kept
as int8 read half the bytes of their bfloat16 copies, if the kernel reads the codes as they are:
torch's CUDA `_weight_int8pack_mm` loops over K in one thread per output (59 tok/s on the E2B
shape), and torch.compile's fusion of a multiply and a row sum ran the step at 288 tok/s against
344 for bfloat16 copies in cuBLAS (docs/benchmarks.md). This kernel is the plain GEMV: each
program owns a block of rows, walks K in tiles, and accumulates in float32; Triton is the
well-kept route to it (it ships with torch's CUDA wheels). One tile for every shape, and K split
for matrices with few rows, rather than Triton's autotuner: autotuning times each candidate with
a 256 MB cache-flush buffer on the GPU, which would break the plan's memory budget at the first
step of every shape. It is a torch
custom op, so torch.compile keeps it whole in the fused step and the CUDA graph replays it.
"""

from __future__ import annotations

import functools

import torch


BLOCK_N, BLOCK_K = 16, 256  # a program's tile: 4 KB of codes, 32 bytes a thread at 4 warps
PROGRAMS_PER_SM = 4  # enough programs in flight to keep the memory system busy


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
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for offset in range(0, K_PER, BLOCK_K):
            cols = first + offset + tl.arange(0, BLOCK_K)  # [BK]
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BK]
            q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)  # [BN, BK]
            acc += tl.sum(q * x[None, :], axis=1)
        scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + tl.program_id(1) * N + rows, (acc * scale).to(y_ptr.dtype.element_ty), mask=row_ok)

    return triton, int8_rows_gemv


@functools.cache
def split(out_features: int, in_features: int, sms: int) -> tuple[int, int]:
    """(splits, columns per split): a matrix with too few row blocks to give every multiprocessor
    PROGRAMS_PER_SM programs (v_proj, down_proj) splits K, and its partial sums are added after."""
    row_blocks = -(-out_features // BLOCK_N)
    tiles = -(-in_features // BLOCK_K)
    splits = max(1, min(tiles, -(-PROGRAMS_PER_SM * sms // row_blocks)))
    per = -(-tiles // splits) * BLOCK_K
    return -(-in_features // per), per


def _sms(device: torch.device) -> int:
    """The device's multiprocessors (1 off CUDA: Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@torch.library.custom_op("gemmactl::int8_rows_gemv", mutates_args=())
def int8_rows_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [in] (one token) · (qweight [out, in] int8 × scales [out]) → [out] in x's dtype."""
    triton, kernel = _kernel()
    out_features, in_features = qweight.shape
    splits, per = split(out_features, in_features, _sms(x.device))
    if splits == 1:
        y = torch.empty(out_features, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((splits, out_features), dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(out_features, BLOCK_N), splits)](x.contiguous(), qweight, scales, y, out_features, in_features,
                                                         qweight.stride(0), per, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                                         num_warps=4)
    return y if splits == 1 else y.sum(0).to(x.dtype)


@int8_rows_gemv.register_fake
def _(x, qweight, scales):
    return x.new_empty(qweight.shape[0])


def available(device) -> bool:
    """Whether the kernel can run on device (CUDA with Triton importable)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
