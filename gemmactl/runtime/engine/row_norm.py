"""RMSNorm on CUDA in a Triton kernel that gives a row the same bits whatever rows run beside it.

Greedy speculation must give plain decoding's tokens, so a verify step's row (one of k + 1) must
get the logits a one-token decode step gives it, bit for bit. torch's own norm is several kernels
(a cast, a square, a mean, a root, two products, a cast back), each launched for the shape at
hand; here one program normalizes one row, loaded whole, with warps fixed by the row's width, so a
row's sum never depends on the rows around it, in one launch. ops.rms_norm runs it on CUDA where
the step is not fused (eager, or captured unfused as a streamed model's step is). Inside a step
fused by torch.compile it cuts the fusion around every norm: asked for there
(GEMMACTL_ENGINE_NORM=kernel) an E4B shape decoded 225 tok/s against 249 on an H100
(docs/benchmarks.md). It is a torch custom op, so torch.compile keeps it whole and a CUDA graph
replays it.
Triton ships with torch's CUDA wheels; the arithmetic is `ops.rms_norm`'s: float32, then the
input's dtype.
"""

from __future__ import annotations

import functools

import torch

MAX_WIDTH = 1 << 15  # a row is loaded whole; wider rows (none in Gemma) take torch's norm


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, width, stride_x, eps, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one row a program: its sum is this program's alone
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        mean = tl.sum(x * x, axis=0) / width
        y = x * (1.0 / tl.sqrt_rn(mean + eps))  # as ops.rms_norm: times the root's reciprocal
        if HAS_SCALE:
            y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=ok)

    return triton, rms_norm_rows


def warps_for(block: int) -> int:
    """Warps by the row's width alone (never by the number of rows): 1 up to 256 values, 8 from 4,096."""
    return max(1, min(8, block // 256))


@torch.library.custom_op("gemmactl::rms_norm_rows", mutates_args=())
def rms_norm_rows(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over x's last axis (x [..., width] on CUDA), times scale [width] (float32) when given,
    in x's dtype: each row's result independent of the other rows."""
    triton, kernel = _kernel()
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = torch.empty((flat.shape[0], width), dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        block = triton.next_power_of_2(width)
        kernel[(flat.shape[0],)](flat, scale if scale is not None else flat, y, width, flat.stride(0), eps,
                                 HAS_SCALE=scale is not None, BLOCK=block, num_warps=warps_for(block))
    return y.reshape(x.shape)


@rms_norm_rows.register_fake
def _(x, scale, eps):
    return torch.empty_like(x)


def usable(x: torch.Tensor) -> bool:
    """Whether x's norm runs here: on CUDA with Triton, a row no wider than MAX_WIDTH."""
    from gemmactl.runtime.engine.gemv_common import available

    return x.is_cuda and x.shape[-1] <= MAX_WIDTH and available(x.device)
