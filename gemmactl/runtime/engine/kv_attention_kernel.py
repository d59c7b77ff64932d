"""The Triton kernel of kv_attention.py (imported only where Triton is: it ships with torch's CUDA
wheels). See kv_attention.py for what it computes and why."""

import triton
import triton.language as tl


@triton.jit
def _decode(codes_ptr, scales_ptr, levels_ptr, slots, ok, head, kv_heads, row_bytes,
            D: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """[BLOCK, D] keys or values of these slots and head, in DOT (bfloat16, as the torch read gives them)."""
    d = tl.arange(0, D)
    bit = (d % 8) * BITS  # eight codes to BITS bytes: code i of a group starts at bit i·BITS
    first = (d // 8) * BITS + bit // 8
    shift = bit % 8
    base = codes_ptr + (slots[:, None] * kv_heads + head) * row_bytes
    low = tl.load(base + first[None, :], mask=ok[:, None], other=0).to(tl.int32)
    if BITS == 8 or BITS == 4 or BITS == 2:  # never straddles a byte
        code = (low >> shift[None, :]) & ((1 << BITS) - 1)
    else:
        spill = (shift + BITS > 8)[None, :] & ok[:, None]
        high = tl.load(base + first[None, :] + 1, mask=spill, other=0).to(tl.int32)
        code = ((low | (high << 8)) >> shift[None, :]) & ((1 << BITS) - 1)
    level = tl.load(levels_ptr + code)  # [BLOCK, D] float32
    scale = tl.load(scales_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)
    return (level * scale[:, None]).to(DOT)

@triton.jit
def quantized_attention(q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, kpos_ptr, pos_ptr,
                        m_ptr, l_ptr, acc_ptr, S, kv_heads, groups, k_row_bytes, v_row_bytes,
                        per_share, shares, query_scale, window,
                        D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                        GROUPS: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr):
    row_head = tl.program_id(0)  # t · kv_heads + head
    share = tl.program_id(1)
    t = row_head // kv_heads
    head = row_head % kv_heads
    g = tl.arange(0, GROUPS)
    d = tl.arange(0, D)
    g_ok = g < groups
    q = tl.load(q_ptr + ((row_head * groups + g[:, None]) * D + d[None, :]), mask=g_ok[:, None],
                other=0.0).to(DOT)  # [G, D]
    position = tl.load(pos_ptr + t)
    most = tl.full((GROUPS,), -3.0e38, dtype=tl.float32)
    total = tl.zeros((GROUPS,), dtype=tl.float32)
    summed = tl.zeros((GROUPS, D), dtype=tl.float32)
    start = share * per_share
    for offset in range(0, per_share, BLOCK):
        slots = start + offset + tl.arange(0, BLOCK)
        ok = slots < S
        kpos = tl.load(kpos_ptr + slots, mask=ok, other=-1)
        seen = ok & (kpos >= 0) & (kpos <= position)
        if window > 0:
            seen = seen & (kpos > position - window)
        k = _decode(kc_ptr, ks_ptr, kl_ptr, slots, ok, head, kv_heads, k_row_bytes, D, K_BITS, DOT)
        scores = tl.dot(q, tl.trans(k)) * query_scale  # [G, BLOCK] float32
        scores = tl.where(seen[None, :], scores, -3.0e38)
        new_most = tl.maximum(most, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_most[:, None])
        kept = tl.exp(most - new_most)
        total = total * kept + tl.sum(weights, axis=1)
        v = _decode(vc_ptr, vs_ptr, vl_ptr, slots, ok, head, kv_heads, v_row_bytes, D, V_BITS, DOT)
        summed = summed * kept[:, None] + tl.dot(weights.to(DOT), v)
        most = new_most
    out = (row_head * shares + share) * GROUPS + g
    tl.store(m_ptr + out, most)
    tl.store(l_ptr + out, total)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], summed)
