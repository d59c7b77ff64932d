"""The Triton kernels of kv_attention.py (imported only where Triton is: it ships with torch's CUDA
wheels). See kv_attention.py for what they compute, and kv.py for the layout of the codes."""

import triton
import triton.language as tl


@triton.jit
def _plane(words_ptr, slots, ok, head, kv_heads, row_words, j, OFFSET: tl.constexpr, R: tl.constexpr):
    """[BLOCK, C] 32-bit words of one plane of these slots' codes: column j's (the plane's word j // R)."""
    base = words_ptr + (slots[:, None] * kv_heads + head) * row_words + OFFSET
    return tl.load(base + (j // R)[None, :], mask=ok[:, None], other=0)


@triton.jit
def _field(main, low, j, f, W0: tl.constexpr, W1: tl.constexpr):
    """[BLOCK, C] codes of field f: coordinate (32 / W0)·j + f of each slot, its W0 bits from the
    main plane's word j and (W1 > 0) W1 more from the second plane's."""
    code = (main >> (f * W0)) & ((1 << W0) - 1)
    if W1 > 0:
        R: tl.constexpr = W0 // W1
        shift = (j % R) * (32 // R) + f * W1
        code = code | (((low >> shift[None, :]) & ((1 << W1) - 1)) << W0)
    return code


@triton.jit
def key_scores(q_ptr, kw_ptr, ks_ptr, kl_ptr, kpos_ptr, pos_ptr, s_ptr, S, kv_heads, groups, row_words,
               query_scale, window,
               D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
               DOT: tl.constexpr):
    """Scores [T·K, groups, S] (float32) of one query row's heads of one KV head against a block of
    slots: the keys' words read once, each field's levels looked up and multiplied with the
    query's coordinates of that field, then scaled by each key's scale; unseen slots at -3e38."""
    F: tl.constexpr = 32 // W0
    C: tl.constexpr = D // F
    row_head = tl.program_id(0)  # t · kv_heads + head
    block = tl.program_id(1)
    t = row_head // kv_heads
    head = row_head % kv_heads
    slots = block * BLOCK + tl.arange(0, BLOCK)
    ok = slots < S
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    j = tl.arange(0, C)
    main = _plane(kw_ptr, slots, ok, head, kv_heads, row_words, j, 0, 1)
    low = main
    if W1 > 0:
        low = _plane(kw_ptr, slots, ok, head, kv_heads, row_words, j, D * W0 // 32, W0 // W1)
    acc = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    for f in tl.static_range(F):
        k = tl.load(kl_ptr + _field(main, low, j, f, W0, W1))  # [BLOCK, C] float32
        q = tl.load(q_ptr + (row_head * groups + g[:, None]) * D + (F * j + f)[None, :], mask=g_ok[:, None],
                    other=0.0)
        if C >= 16:
            acc += tl.dot(q.to(DOT), tl.trans(k.to(DOT)))
        else:  # too narrow for tl.dot (small test models)
            acc += tl.sum(q.to(tl.float32)[:, None, :] * k[None, :, :], axis=2)
    scale = tl.load(ks_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)
    position = tl.load(pos_ptr + t)
    kpos = tl.load(kpos_ptr + slots, mask=ok, other=-1)
    seen = ok & (kpos >= 0) & (kpos <= position)
    if window > 0:
        seen = seen & (kpos > position - window)
    scores = tl.where(seen[None, :], acc * scale[None, :] * query_scale, -3.0e38)
    tl.store(s_ptr + (row_head * groups + g[:, None]) * S + slots[None, :], scores, mask=g_ok[:, None] & ok[None, :])


@triton.jit
def _weigh(acc, w, v, C: tl.constexpr, DOT: tl.constexpr):
    """acc [G, C] + w [G, BLOCK] · v [BLOCK, C]."""
    if C >= 16:
        return acc + tl.dot(w.to(DOT), v.to(DOT))
    return acc + tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # too narrow for tl.dot (small test models)


@triton.jit
def weighted_values(w_ptr, vw_ptr, vs_ptr, vl_ptr, out_ptr, S, kv_heads, groups, row_words, per_share, shares,
                    D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                    DOT: tl.constexpr):
    """One share of the slots' values, weighted, for four fields of coordinates: [T·K, shares,
    groups, D] (float32), a program to a query row and KV head, a share of the slots and four
    fields (every mode has at least four: 32 / W0), which share each block's weights and words.
    The weights (the softmax, normalized) come from key_scores; each value's scale is folded into
    its weight."""
    F: tl.constexpr = 32 // W0
    C: tl.constexpr = D // F
    row_head = tl.program_id(0)
    share = tl.program_id(1)
    f = tl.program_id(2) * 4
    head = row_head % kv_heads
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    j = tl.arange(0, C)
    acc0 = tl.zeros((GROUPS, C), dtype=tl.float32)
    acc1 = tl.zeros((GROUPS, C), dtype=tl.float32)
    acc2 = tl.zeros((GROUPS, C), dtype=tl.float32)
    acc3 = tl.zeros((GROUPS, C), dtype=tl.float32)
    start = share * per_share
    for offset in range(0, per_share, BLOCK):
        slots = start + offset + tl.arange(0, BLOCK)
        ok = slots < S
        w = tl.load(w_ptr + (row_head * groups + g[:, None]) * S + slots[None, :], mask=g_ok[:, None] & ok[None, :],
                    other=0.0)
        w = w * tl.load(vs_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)[None, :]
        main = _plane(vw_ptr, slots, ok, head, kv_heads, row_words, j, 0, 1)
        low = main
        if W1 > 0:
            low = _plane(vw_ptr, slots, ok, head, kv_heads, row_words, j, D * W0 // 32, W0 // W1)
        acc0 = _weigh(acc0, w, tl.load(vl_ptr + _field(main, low, j, f, W0, W1)), C, DOT)
        acc1 = _weigh(acc1, w, tl.load(vl_ptr + _field(main, low, j, f + 1, W0, W1)), C, DOT)
        acc2 = _weigh(acc2, w, tl.load(vl_ptr + _field(main, low, j, f + 2, W0, W1)), C, DOT)
        acc3 = _weigh(acc3, w, tl.load(vl_ptr + _field(main, low, j, f + 3, W0, W1)), C, DOT)
    out = out_ptr + ((row_head * shares + share) * groups + g[:, None]) * D + (F * j + f)[None, :]
    tl.store(out, acc0, mask=g_ok[:, None])
    tl.store(out + 1, acc1, mask=g_ok[:, None])
    tl.store(out + 2, acc2, mask=g_ok[:, None])
    tl.store(out + 3, acc3, mask=g_ok[:, None])
