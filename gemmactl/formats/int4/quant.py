"""The int4-stream arithmetic: group-wise asymmetric int4, row-wise int8, and nibble packing.

Shapes: R = rows, C = columns, Cp = C padded up to a multiple of the group, g = group size,
G = Cp / g groups per row. Every function works on whatever device its inputs live on.

int4: a group of g consecutive values of one row is coded as q in 0..15 with
    w ≈ q * scale + zero          (scale, zero: float16; zero is the value code 0 decodes to)
int8: a row is coded as q in -127..127 with w ≈ q * scale (scale: float16, one per row).

quantize_int4 fits each group by its min and max; quantize_int4_search searches for the
(scale, zero) with the least (optionally importance-weighted) squared error. Both write the
same layout; only the values chosen differ.
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


def group_sq_error(
    groups: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """[R, G] weighted squared error of coding groups [R, G, g] with fp16 scales/zeros [R, G], as decoded."""
    scale = scales.float().unsqueeze(-1)  # [R, G, 1]
    zero = zeros.float().unsqueeze(-1)  # [R, G, 1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups - zero).div_(safe).round_().clamp_(0, INT4_MAX)  # [R, G, g]
    return torch.addcmul(zero, codes, scale).sub_(groups).square_().mul_(weights).sum(dim=-1)


# Candidate code ranges tried by the search: the min..max range is stretched over 15 + delta steps.
SEARCH_DELTAS = tuple(d / 10 for d in range(-10, 11))


def quantize_int4_search(
    w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like quantize_int4, but each group's (scale, zero) minimizes its weighted squared error.

    importance: [C] non-negative weight per column (e.g. the mean square of the activations that
    column multiplies), or None for plain squared error. For each candidate step count 15 + delta
    the codes of the min/max grid are refitted by weighted least squares (scale and zero of the
    line through (code, value)), the codes are rounded again, and the best candidate is kept. The
    min/max result (quantize_int4's) is always a candidate and wins ties, so no group's error, as
    decoded from the stored fp16 values, is ever larger than quantize_int4's.
    """
    rows, cols = w.shape
    groups = pad_to_groups(w.float(), group_size).reshape(rows, -1, group_size)  # [R, G, g]
    weight = torch.ones(cols, device=w.device) if importance is None else importance.float().to(w.device)
    weight = torch.cat((weight, weight.new_zeros(-cols % group_size)))  # padding counts for nothing
    weights = weight.reshape(1, -1, group_size).expand_as(groups)  # [R, G, g]

    packed, best_scales, best_zeros = quantize_int4(w, group_size)  # the min/max candidate
    best = group_sq_error(groups, weights, best_scales, best_zeros)  # [R, G]
    low = groups.amin(dim=-1, keepdim=True)  # [R, G, 1]
    span = groups.amax(dim=-1, keepdim=True) - low  # [R, G, 1]
    live = span > 0
    sw = weights.sum(-1, keepdim=True)  # [R, G, 1]
    sx = (weights * groups).sum(-1, keepdim=True)  # [R, G, 1]
    for delta in SEARCH_DELTAS:
        inv = torch.where(live, (INT4_MAX + delta) / torch.where(live, span, 1.0), 0.0)  # [R, G, 1]
        codes = (groups - low).mul_(inv).round_().clamp_(0, INT4_MAX)  # [R, G, g]
        # Least squares for w ≈ s·code + z with weights: the normal equations of a weighted line.
        wl = weights * codes
        sl = wl.sum(-1, keepdim=True)
        sll = (wl * codes).sum(-1, keepdim=True)
        slx = (wl * groups).sum(-1, keepdim=True)
        det = sw * sll - sl * sl
        ok = live & (det > 0)
        det = torch.where(ok, det, 1.0)
        scale = (sw * slx - sl * sx) / det
        zero = (sll * sx - sl * slx) / det
        ok &= scale > 0
        scales = torch.where(ok, scale, 0.0).squeeze(-1).to(torch.float16)  # [R, G]
        zeros = torch.where(ok, zero, low).squeeze(-1).to(torch.float16)
        error = group_sq_error(groups, weights, scales, zeros)
        better = ok.squeeze(-1) & torch.isfinite(scales) & torch.isfinite(zeros) & (error < best)
        best = torch.where(better, error, best)
        best_scales = torch.where(better, scales, best_scales)
        best_zeros = torch.where(better, zeros, best_zeros)
    scale = best_scales.float().unsqueeze(-1)
    zero = best_zeros.float().unsqueeze(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups - zero).div_(safe).round_().clamp_(0, INT4_MAX).to(torch.uint8).reshape(rows, -1)  # [R, Cp]
    return pack_nibbles(codes), best_scales, best_zeros


def _chunk_rows(rows: int, cols: int, device: torch.device) -> int:
    """Rows decoded at once: about 2 MB of float32 on a CPU (the temporaries stay in cache), 256 MB on a GPU."""
    values = (1 << 19) if device.type == "cpu" else (1 << 26)
    return max(1, min(rows, values // max(cols, 1)))


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    cols: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(packed [R, Cp/2], scales [R, G], zeros [R, G]) → [R, C] in dtype, a block of rows at a time.

    Each value is computed in float32 as code · scale + zero, then rounded once to dtype.
    """
    rows, groups = scales.shape
    group_size = packed.shape[1] * 2 // groups
    out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
    step = _chunk_rows(rows, groups * group_size, packed.device)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        codes = unpack_nibbles(packed[start:stop]).view(stop - start, groups, group_size)  # [r, G, g]
        values = codes.float().mul_(scales[start:stop].float().unsqueeze(-1)).add_(zeros[start:stop].float().unsqueeze(-1))
        out[start:stop] = values.view(stop - start, -1)[:, :cols]
    return out


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float → (q [R, C] int8, scales [R] fp16), symmetric per row."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).to(torch.float16)  # [R]
    scale = scales.float().unsqueeze(1)  # [R, 1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row codes to 0
    q = w.div(safe).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_int8_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [R, C] int8, scales [R] fp16) → [R, C] in dtype (float32 product, rounded once to dtype)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    step = _chunk_rows(q.shape[0], q.shape[1], q.device)
    for start in range(0, q.shape[0], step):
        stop = min(q.shape[0], start + step)
        out[start:stop] = q[start:stop].float().mul_(scales[start:stop].float().unsqueeze(1))  # [r, C] · [r, 1]
    return out


def int4_error_bound(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Largest |w - decoded| a group may show: scale/2 plus the fp16 rounding of zero and 15·scale."""
    scale = scales.float()
    half_ulp = 2.0**-11  # fp16 keeps 11 significant bits
    # 2^-20 covers fp16 subnormals (absolute step 2^-24) times 15, and float32 arithmetic.
    return scale / 2 + (zeros.float().abs() + INT4_MAX * scale) * half_ulp + 2.0**-20
