"""The int4-stream arithmetic: group-wise asymmetric int4, row-wise int8, and nibble packing.

Shapes: R = rows, C = columns, Cp = C padded up to a multiple of the group, g = group size,
G = Cp / g groups per row. Every function works on whatever device its inputs live on.

int4: a group of g consecutive values of one row is coded as q in 0..15 with
    w ≈ q * scale + zero          (scale, zero: float16; zero is the value code 0 decodes to)
int8: a row is coded as q in -127..127 with w ≈ q * scale (scale: float16, one per row).
"""

from __future__ import annotations

import torch

INT4_MAX = 15
INT8_MAX = 127


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes 0..15 → [..., n] bytes: even index in the low nibble, odd in the high."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n] uint8 codes (inverse of pack_nibbles)."""
    codes = torch.empty((*packed.shape, 2), dtype=torch.uint8, device=packed.device)  # [..., n, 2]
    torch.bitwise_and(packed, 0x0F, out=codes[..., 0])
    torch.bitwise_right_shift(packed, 4, out=codes[..., 1])
    return codes.flatten(-2)


def pad_to_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[R, C] → [R, Cp], repeating each row's last value so the last group's min and max stay its own."""
    rows, cols = w.shape
    pad = -cols % group_size
    if pad == 0:
        return w
    return torch.cat((w, w[:, -1:].expand(rows, pad)), dim=1)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] float → (packed [R, Cp/2] uint8, scales [R, G] fp16, zeros [R, G] fp16)."""
    rows, _ = w.shape
    groups = pad_to_groups(w.float(), group_size).reshape(rows, -1, group_size)  # [R, G, g]
    low = groups.amin(dim=-1)  # [R, G]
    high = groups.amax(dim=-1)  # [R, G]
    scales = ((high - low) / INT4_MAX).to(torch.float16)
    zeros = low.to(torch.float16)
    # Codes are computed from the fp16 values actually stored, so decoding sees the same numbers.
    scale = scales.float().unsqueeze(-1)  # [R, G, 1]
    zero = zeros.float().unsqueeze(-1)  # [R, G, 1]
    # A zero scale means a (numerically) constant group: every code is 0. In place, to keep
    # the temporaries to one block-sized tensor.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups - zero).div_(safe).round_().clamp_(0, INT4_MAX).to(torch.uint8).reshape(rows, -1)  # [R, Cp]
    return pack_nibbles(codes), scales, zeros


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    cols: int,
    dtype: torch.dtype = torch.float32,
    chunk_rows: int = 8192,
) -> torch.Tensor:
    """(packed [R, Cp/2], scales [R, G], zeros [R, G]) → [R, C] in dtype, a block of rows at a time."""
    rows, groups = scales.shape
    group_size = packed.shape[1] * 2 // groups
    out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        codes = unpack_nibbles(packed[start:stop]).reshape(stop - start, groups, group_size)  # [r, G, g]
        zero = zeros[start:stop].float().unsqueeze(-1)  # [r, G, 1]
        scale = scales[start:stop].float().unsqueeze(-1)  # [r, G, 1]
        if dtype == torch.float32 and cols == groups * group_size:
            # Decode straight into the output: no temporary of the block's size.
            torch.addcmul(zero, codes.float(), scale, out=out[start:stop].view(stop - start, groups, group_size))
        else:
            out[start:stop] = torch.addcmul(zero, codes.float(), scale).reshape(stop - start, -1)[:, :cols]
    return out


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float → (q [R, C] int8, scales [R] fp16), symmetric per row."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).to(torch.float16)  # [R]
    scale = scales.float().unsqueeze(1)  # [R, 1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row codes to 0
    q = w.div(safe).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_int8_rows(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, chunk_rows: int = 16384
) -> torch.Tensor:
    """(q [R, C] int8, scales [R] fp16) → [R, C] in dtype."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for start in range(0, q.shape[0], chunk_rows):
        stop = min(q.shape[0], start + chunk_rows)
        scale = scales[start:stop].float().unsqueeze(1)  # [r, 1]
        if dtype == torch.float32:
            out[start:stop].copy_(q[start:stop]).mul_(scale)
        else:
            out[start:stop] = q[start:stop].float().mul_(scale)
    return out


def int4_error_bound(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Largest |w - decoded| a group may show: scale/2 plus the fp16 rounding of zero and 15·scale."""
    scale = scales.float()
    half_ulp = 2.0**-11  # fp16 keeps 11 significant bits
    # 2^-20 covers fp16 subnormals (absolute step 2^-24) times 15, and float32 arithmetic.
    return scale / 2 + (zeros.float().abs() + INT4_MAX * scale) * half_ulp + 2.0**-20
