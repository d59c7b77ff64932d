"""Attention of a few query rows over a quantized KV cache, reading the codes inside Triton kernels.

A decode step over a quantized cache (kv.py: int8, tq4, tq3) used to decode a block of slots into
bfloat16 keys and values with torch operations, then score them: about ten kernels and 24 bytes of
temporaries per cached element, so at 32K slots tq4 decoded slower than the bfloat16 cache it
shrinks (0.67x on an E4B shape, docs/benchmarks.md). Here the codes are read in place, in two
kernels (kv_attention_kernel.py):

- key_scores: a program to a query row, a KV head and a block of slots reads the keys' 32-bit
  words once, takes each field of coordinates from them by shifts (kv.py stores codes in planes of
  whole fields, so none straddles a word), looks the levels up and multiplies them with the
  query's coordinates of that field; the scores are scaled by each key's scale and masked;
- the softmax over those few rows' scores, in torch (16 bytes a slot for Gemma 4's four query
  heads a KV head, against 516 of a tq4 key and value at 512 coordinates);
- weighted_values: a program to a query row, a KV head, a share of the slots and four fields of
  coordinates adds up the values weighted (each value's scale folded into its weight); the shares
  are summed after.

Nothing the size of the cache is made but the scores. An earlier single kernel (a running softmax,
codes unpacked from the bytes they straddle) took about 60 instructions a coordinate and spilled
registers; this one takes about 17, and read 1.7-2.8x faster on an H100 (docs/benchmarks.md).
Triton is the well-kept route (it ships with torch's CUDA wheels); the read is a torch custom op,
so torch.compile keeps it whole in the fused step and the CUDA graph replays it.

Every mode is one layout to the kernels: codes of `bits` bits in planes (kv_modes.code_planes), a
level table indexed by the code, and an fp16 scale per vector. int8 is one 8-bit plane with the
table of the signed byte values. The queries come in turned by the cache's rotation and the output
leaves in that space: the caller adds the values' centre and turns it back (model.py, as for the
torch read).
"""

from __future__ import annotations

import functools
import os

import torch

from gemmactl.runtime.engine.gemv_common import available, dot_dtype
from gemmactl.runtime.engine.gemv_common import sms as _sms
from gemmactl.runtime.engine.kv_modes import FUSED_ROWS_MAX, code_planes

ENV = "GEMMACTL_KV_KERNEL"  # auto (on for CUDA with Triton) | off (the torch read) | on (also Triton's CPU interpreter)
BLOCK_SLOTS = 32  # slots a program decodes at a time (tl.dot needs 16 at least)
ROWS_MAX = FUSED_ROWS_MAX  # query rows (tokens) a call takes: a decode step, a verify step; prefill reads by blocks
PROGRAMS_PER_SM = 8  # the values' programs: enough to keep each multiprocessor's loads in flight


MIN_SLOTS_ENV = "GEMMACTL_KV_KERNEL_MIN_SLOTS"  # caches shorter than this are read by torch (default 0: none)


def usable(device, rows: int, head_dim: int, slots: int | None = None) -> bool:
    """Whether the fused read takes rows query rows of head_dim (over slots slots) on device: CUDA
    with Triton (unless ENV is off), or Triton's CPU interpreter when ENV is on (the tests' way to
    run it). MIN_SLOTS_ENV leaves short caches (a sliding layer's window) to the torch read, which
    a fused step compiles with its neighbours, where the kernel's several launches cost more than
    the read; to measure (not yet measured)."""
    setting = os.environ.get(ENV, "auto")
    if setting == "off" or rows > ROWS_MAX or head_dim & (head_dim - 1) or head_dim % 32:
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
    import triton

    from gemmactl.runtime.engine import kv_attention_kernel as kernels

    return triton, kernels, dot_dtype()


def shares_for(slots: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(shares, slots per share) for `programs` programs a share over slots: enough shares that the
    GPU's multiprocessors each get PROGRAMS_PER_SM programs, a whole number of blocks each."""
    blocks = -(-slots // BLOCK_SLOTS)
    shares = max(1, min(blocks, -(-PROGRAMS_PER_SM * _sms(device) // max(programs, 1))))
    per = -(-blocks // shares) * BLOCK_SLOTS
    return -(-slots // per), per


def _warps(dim: int, main_bits: int) -> int:
    """Warps a program: 8 where a field is 128 coordinates or wider (int8 at 512: four fields'
    accumulators and tiles spilled registers at 4 warps, compiled for sm_90), else 4."""
    return 8 if dim * main_bits // 32 >= 128 else 4


@torch.library.custom_op("gemmactl::quantized_attention", mutates_args=())
def quantized_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, k_levels: torch.Tensor,
                        v_codes: torch.Tensor, v_scales: torch.Tensor, v_levels: torch.Tensor,
                        key_positions: torch.Tensor, positions: torch.Tensor, k_bits: int, v_bits: int,
                        query_scale: float, window: int) -> torch.Tensor:
    """softmax(q·k · query_scale, masked) v for query rows q [T, K, g, D] (turned as the cache
    turns its vectors) at positions [T] over a cache of S slots: codes [S, K, D·bits/8] (uint8),
    scales [S, K] (fp16), levels [2**bits] (float32), key_positions [S] (-1: unwritten). A key is
    seen when written, at or before the row's position, and within window (0: no window).
    Returns [T, K, g, D] in float32."""
    triton, kernels, dot = _kernel()
    t, kv_heads, groups, dim = q.shape
    slots = k_codes.shape[0]
    group_block = max(16, triton.next_power_of_2(groups))
    q = q.contiguous()
    (k0, k1), (v0, v1) = code_planes(k_bits), code_planes(v_bits)
    scores = torch.empty((t * kv_heads, groups, slots), dtype=torch.float32, device=q.device)
    kernels.key_scores[(t * kv_heads, triton.cdiv(slots, BLOCK_SLOTS))](
        q, k_codes.view(torch.int32), k_scales, k_levels, key_positions, positions, scores, slots, kv_heads, groups,
        k_codes.shape[-1] // 4, query_scale, window, D=dim, W0=k0, W1=k1, GROUPS=group_block, BLOCK=BLOCK_SLOTS,
        DOT=dot, num_warps=_warps(dim, k0))
    # The softmax over a few rows' scores (16 bytes a slot and KV head for Gemma 4's 4 query heads a
    # KV head, against 516 of a tq4 key and value of 512 coordinates): in place, normalized, so the
    # values' shares only add up.
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    scores.div_(scores.sum(-1, keepdim=True))
    quads = 32 // v0 // 4  # weighted_values takes four fields of coordinates a program
    shares, per = shares_for(slots, t * kv_heads * quads, q.device)
    parts = torch.empty((t * kv_heads, shares, groups, dim), dtype=torch.float32, device=q.device)
    kernels.weighted_values[(t * kv_heads, shares, quads)](
        scores, v_codes.view(torch.int32), v_scales, v_levels, parts, slots, kv_heads, groups, v_codes.shape[-1] // 4,
        per, shares, D=dim, W0=v0, W1=v1, GROUPS=group_block, BLOCK=BLOCK_SLOTS, DOT=dot, num_warps=_warps(dim, v0))
    return parts.sum(1).reshape(t, kv_heads, groups, dim)


@quantized_attention.register_fake
def _(q, k_codes, k_scales, k_levels, v_codes, v_scales, v_levels, key_positions, positions, k_bits, v_bits,
      query_scale, window):
    return q.new_empty(q.shape, dtype=torch.float32)
