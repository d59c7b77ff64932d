"""Attention of a few query rows over a quantized KV cache, reading the codes inside a Triton kernel.

A decode step over a quantized cache (kv.py: int8, tq4, tq3) used to decode a block of slots into
bfloat16 keys and values with torch operations, then score them: about ten kernels and 24 bytes of
temporaries per cached element, so at 32K slots tq4 decoded slower than the bfloat16 cache it
shrinks (0.67x on an E4B shape, docs/benchmarks.md). This kernel reads each packed code once: a
program owns one query row and one KV head (all of that head's query heads) and a share of the
slots, unpacks each coordinate's code from the bytes it straddles, looks its level up, scales it
by the vector's scale, and folds the block into a running softmax (split over the slots as in
flash-decoding; the shares are merged after, in float32). Nothing the size of the cache is ever
made. Triton is the well-kept route (it ships with torch's CUDA wheels). Only the kernel's launch
is a torch custom op: the merge of the shares is plain torch after it, so in the fused step
torch.compile joins the merge to the operations around it, and the CUDA graph replays it all.
Inside the op its operations were eight launches of their own a read: for an E4B shape at 32K on
an H100, 1,368 kernels a step against 1,032, and 99.7 against 114.7 tok/s (docs/benchmarks.md).

Every mode is one layout to the kernel: codes of `bits` bits, eight to `bits` bytes (kv.py packs
them so; two to a byte at 4 bits is the same order), a level table indexed by the code, and an
fp16 scale per vector. int8 is bits 8 with the table of the signed byte values. The queries come
in turned by the cache's rotation and the output leaves in that space: the caller adds the
values' centre and turns it back (model.py, as for the torch read).
"""

from __future__ import annotations

import functools
import os

import torch

from gemmactl.runtime.engine.gemv_common import available, dot_dtype
from gemmactl.runtime.engine.gemv_common import sms as _sms

ENV = "GEMMACTL_KV_KERNEL"  # auto (on for CUDA with Triton) | off (the torch read) | on (also Triton's CPU interpreter)
BLOCK_SLOTS = 16  # slots a program decodes at a time (tl.dot needs 16 at least)
ROWS_MAX = 16  # query rows (tokens) a call takes: a decode step, a verify step; prefill reads by blocks
PROGRAMS_PER_SM = 2  # shares of the slots: enough programs to fill the GPU at one query row


def usable(device, rows: int, head_dim: int) -> bool:
    """Whether the fused read takes rows query rows of head_dim on device: CUDA with Triton (unless
    ENV is off), or Triton's CPU interpreter when ENV is on (the tests' way to run it)."""
    setting = os.environ.get(ENV, "auto")
    if setting == "off" or rows > ROWS_MAX or head_dim & (head_dim - 1):
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
    import triton

    from gemmactl.runtime.engine.kv_attention_kernel import quantized_attention as kernel

    return triton, kernel, dot_dtype()


def shares_for(slots: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(shares, slots per share) for rows · kv_heads programs over slots: enough shares that the
    GPU's multiprocessors each get PROGRAMS_PER_SM programs, a whole number of blocks each."""
    blocks = -(-slots // BLOCK_SLOTS)
    shares = max(1, min(blocks, -(-PROGRAMS_PER_SM * _sms(device) // max(rows, 1))))
    per = -(-blocks // shares) * BLOCK_SLOTS
    return -(-slots // per), per


@torch.library.custom_op("gemmactl::quantized_attention_shares", mutates_args=())
def quantized_attention_shares(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_levels: torch.Tensor,
                               v_codes: torch.Tensor, v_scales: torch.Tensor, v_levels: torch.Tensor,
                               key_positions: torch.Tensor, positions: torch.Tensor, k_bits: int, v_bits: int,
                               query_scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's launch alone: each share's running maximum, sum of weights [T·K, shares, G]
    and weighted values [T·K, shares, G, D] (float32; G the groups padded to a block), for
    quantized_attention to merge. Only the launch is an opaque op, so a compiled step fuses the
    merge with the operations around it rather than launching each of its operations alone."""
    triton, kernel, dot = _kernel()
    t, kv_heads, groups, dim = q.shape
    slots = k_codes.shape[0]
    shares, per = shares_for(slots, t * kv_heads, q.device)
    group_block = _group_block(groups)
    most = torch.empty((t * kv_heads, shares, group_block), dtype=torch.float32, device=q.device)
    total = torch.empty_like(most)
    summed = torch.empty((t * kv_heads, shares, group_block, dim), dtype=torch.float32, device=q.device)
    kernel[(t * kv_heads, shares)](q.contiguous(), k_codes, k_scales, k_levels, v_codes, v_scales, v_levels,
                                   key_positions, positions, most, total, summed, slots, kv_heads, groups,
                                   k_codes.shape[-1], v_codes.shape[-1], per, shares, query_scale, window,
                                   D=dim, K_BITS=k_bits, V_BITS=v_bits, GROUPS=group_block, BLOCK=BLOCK_SLOTS, DOT=dot,
                                   num_warps=4)
    return most, total, summed


@quantized_attention_shares.register_fake
def _(q, k_codes, k_scales, k_levels, v_codes, v_scales, v_levels, key_positions, positions, k_bits, v_bits,
      query_scale, window):
    t, kv_heads, groups, dim = q.shape
    shares, _ = shares_for(k_codes.shape[0], t * kv_heads, q.device)
    most = q.new_empty((t * kv_heads, shares, _group_block(groups)), dtype=torch.float32)
    return most, torch.empty_like(most), q.new_empty((*most.shape, dim), dtype=torch.float32)


def _group_block(groups: int) -> int:
    """Query heads a program holds: the groups padded to a power of two, 16 at least (tl.dot)."""
    return max(16, 1 << (groups - 1).bit_length())


def quantized_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_levels: torch.Tensor,
                        v_codes: torch.Tensor, v_scales: torch.Tensor, v_levels: torch.Tensor,
                        key_positions: torch.Tensor, positions: torch.Tensor, k_bits: int, v_bits: int,
                        query_scale: float, window: int) -> torch.Tensor:
    """softmax(q·k · query_scale, masked) v for query rows q [T, K, g, D] (turned as the cache
    turns its vectors) at positions [T] over a cache of S slots: codes [S, K, D·bits/8] (uint8),
    scales [S, K] (fp16), levels [2**bits] (float32), key_positions [S] (-1: unwritten). A key is
    seen when written, at or before the row's position, and within window (0: no window).
    Returns [T, K, g, D] in float32."""
    t, kv_heads, groups, dim = q.shape
    most, total, summed = quantized_attention_shares(q, k_codes, k_scales, k_levels, v_codes, v_scales, v_levels,
                                                     key_positions, positions, k_bits, v_bits, query_scale, window)
    most, total, summed = most[:, :, :groups], total[:, :, :groups], summed[:, :, :groups]
    top = most.amax(1, keepdim=True)
    weight = torch.exp(most - top)  # shares with nothing seen weigh nothing
    out = (summed * weight[..., None]).sum(1) / (total * weight).sum(1)[..., None]
    return out.reshape(t, kv_heads, groups, dim)
