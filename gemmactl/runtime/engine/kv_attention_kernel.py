"""The Triton kernels of kv_attention.py (imported only where Triton is: it ships with torch's CUDA
wheels). See kv_attention.py for what they compute, and kv.py for the layout of the codes.

Both kernels take the codes field by field. A main-plane word of W0-bit fields holds F = 32 / W0
codes, coordinate F·j + f in field f of word j, so field f of a block's words is a [BLOCK, words]
tensor of the coordinates F apart, made by one shift and one mask. The second plane holds the W1
high bits of coordinate d at bit d·W1: word j's coordinates take F·W1 bits from bit F·W1·j, which
never straddle a 32-bit word (F·W1 divides 32 for every layout in kv_modes.code_planes). The codes
are never put in coordinate order: a dot product adds in any order, so the keys' fields meet the
query's coordinates at the same places (a strided load of the query), and the values' fields are
stored at theirs."""

import triton
import triton.language as tl


@triton.jit
def _level(code, poly_ptr, WRAP: tl.constexpr, DOT: tl.constexpr):
    """The levels of codes, in DOT: with u = code - mid, u·(c1 + u²·(c3 + u²·c5)) (kv.py's
    polynomial_levels; poly_ptr: mid, c1, c3, c5), a few float operations where a table's lookup
    took an address and a load per code. WRAP (int8): bytes read unsigned whose signed value is
    wanted, the code plus 128 (wrapped) less 128."""
    mid = tl.load(poly_ptr)
    c1 = tl.load(poly_ptr + 1)
    c3 = tl.load(poly_ptr + 2)
    c5 = tl.load(poly_ptr + 3)
    if WRAP:
        code = (code + 128) & 255
    # the code as a float by its bits (2**23 + code, exact), without a conversion instruction
    u = ((code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - mid
    u2 = u * u
    return (u * (c1 + u2 * (c3 + u2 * c5))).to(DOT)


@triton.jit
def _field(main, low, f: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Codes of field f of main-plane words `main`, with their high bits from `low` (the second
    plane's words under them, already shifted to word j's first bit) where W1 > 0."""
    code = (main >> (f * W0)) & ((1 << W0) - 1)
    if W1 > 0:
        code = code | (((low >> (f * W1)) & ((1 << W1) - 1)) << W0)
    return code


@triton.jit
def _planes(row, j, ok, MAIN: tl.constexpr, F: tl.constexpr, W1: tl.constexpr):
    """The main-plane words j [CW] of these slots' vectors (row: [BLOCK, 1] pointers to each
    vector's first 32-bit word; ok: [BLOCK, CW] which to read) and, where W1 > 0, the second
    plane's word holding word j's high bits, shifted to their first (else the main words again)."""
    main = tl.load(row + j[None, :], mask=ok, other=0)
    low = main
    if W1 > 0:
        bit = j * (F * W1)
        low = tl.load(row + MAIN + (bit // 32)[None, :], mask=ok, other=0) >> (bit % 32)[None, :]
    return main, low


@triton.jit
def key_scores(q_ptr, kw_ptr, ks_ptr, kl_ptr, kpos_ptr, pos_ptr, s_ptr, S, kv_heads, groups, row_words,
               query_scale, window,
               D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
               CHUNK: tl.constexpr, DOT: tl.constexpr):
    """Scores [T·K, groups, S] (float32) of one query row's heads of one KV head against a block of
    slots: a run of CW main-plane words at a time (CHUNK coordinates, 16 words at least for
    tl.dot; words past a narrow vector's end read as code 0 against a query of 0), each field's
    levels multiplied with the query's coordinates at the field's places, then scaled by each key's
    scale; unseen slots at -3e38."""
    F: tl.constexpr = 32 // W0
    MAIN: tl.constexpr = D // F  # main-plane words of a vector
    CW: tl.constexpr = CHUNK // F if CHUNK // F >= 16 else 16
    row_head = tl.program_id(0)  # t · kv_heads + head
    block = tl.program_id(1)
    t = row_head // kv_heads
    head = row_head % kv_heads
    slots = block * BLOCK + tl.arange(0, BLOCK)
    ok = slots < S
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    row = kw_ptr + ((slots * kv_heads + head) * row_words)[:, None]
    q_row = q_ptr + (row_head * groups + g[:, None]) * D
    acc = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    for first in tl.static_range(0, MAIN, CW):
        j = first + tl.arange(0, CW)
        j_ok = j < MAIN
        main, low = _planes(row, j, ok[:, None] & j_ok[None, :], MAIN, F, W1)
        for f in tl.static_range(F):
            # An 8-bit plane is int8's alone (kv_modes.code_planes): its bytes wrap to signed values.
            k = _level(_field(main, low, f, W0, W1), kl_ptr, W0 == 8, DOT)  # [BLOCK, CW]: coordinates F·j + f
            q = tl.load(q_row + (F * j + f)[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0)
            acc += tl.dot(q.to(DOT), tl.trans(k))
    scale = tl.load(ks_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)
    position = tl.load(pos_ptr + t)
    kpos = tl.load(kpos_ptr + slots, mask=ok, other=-1)
    seen = ok & (kpos >= 0) & (kpos <= position)
    if window > 0:
        seen = seen & (kpos > position - window)
    scores = tl.where(seen[None, :], acc * (scale * query_scale)[None, :], -3.0e38)
    tl.store(s_ptr + (row_head * groups + g[:, None]) * S + slots[None, :], scores, mask=g_ok[:, None] & ok[None, :])


@triton.jit
def weighted_values(w_ptr, vw_ptr, vs_ptr, vl_ptr, out_ptr, S, kv_heads, groups, row_words, per_share, shares,
                    D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                    CHUNK: tl.constexpr, DOT: tl.constexpr):
    """One share of the slots' values, weighted, for one run of CW main-plane words (F·CW
    coordinates): [T·K, shares, groups, D] (float32), a program to a query row and KV head, a share
    of the slots and a run. The run's codes are taken as [F, BLOCK, CW] (field f: coordinates
    F·j + f) and added in one batched product a block, the same weights for every field, into
    [F, groups, CW], stored at each coordinate's place. The weights (the softmax, normalized) come
    from key_scores; each value is scaled before the product."""
    F: tl.constexpr = 32 // W0
    MAIN: tl.constexpr = D // F
    CW: tl.constexpr = CHUNK // F if CHUNK // F >= 16 else 16
    row_head = tl.program_id(0)
    share = tl.program_id(1)
    j = tl.program_id(2) * CW + tl.arange(0, CW)
    j_ok = j < MAIN
    head = row_head % kv_heads
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    fields = tl.arange(0, F)
    acc = tl.zeros((F, GROUPS, CW), dtype=tl.float32)
    first = share * per_share
    for offset in range(0, per_share, BLOCK):
        slots = first + offset + tl.arange(0, BLOCK)
        ok = slots < S
        w = tl.load(w_ptr + (row_head * groups + g[:, None]) * S + slots[None, :], mask=g_ok[:, None] & ok[None, :],
                    other=0.0)
        scale = tl.load(vs_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)
        row = vw_ptr + ((slots * kv_heads + head) * row_words)[:, None]
        main, low = _planes(row, j, ok[:, None] & j_ok[None, :], MAIN, F, W1)
        code = (main[None, :, :] >> (fields * W0)[:, None, None]) & ((1 << W0) - 1)  # [F, BLOCK, CW]
        if W1 > 0:
            code = code | (((low[None, :, :] >> (fields * W1)[:, None, None]) & ((1 << W1) - 1)) << W0)
        # the scale on the value, not the weight: a weight times a small scale would fall below
        # float16's normal range where long caches spread their weights thin
        v = _level(code, vl_ptr, W0 == 8, tl.float32) * scale[None, :, None]
        acc += tl.dot(tl.broadcast_to(w.to(DOT)[None, :, :], (F, GROUPS, BLOCK)), v.to(DOT))
    out = out_ptr + ((row_head * shares + share) * groups + g[None, :, None]) * D \
        + (F * j[None, None, :] + fields[:, None, None])
    tl.store(out, acc, mask=g_ok[None, :, None] & j_ok[None, None, :])
