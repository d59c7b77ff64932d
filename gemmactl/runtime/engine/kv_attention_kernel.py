"""The Triton kernels of kv_attention.py (imported only where Triton is: it ships with torch's CUDA
wheels). See kv_attention.py for what they compute, and kv.py for the layout of the codes."""

import triton
import triton.language as tl


@triton.jit
def _codes(row, ok, start, W0: tl.constexpr, W1: tl.constexpr, LOW: tl.constexpr, CHUNK: tl.constexpr):
    """[BLOCK, CHUNK] codes of coordinates start .. start + CHUNK of these slots' vectors (row:
    [BLOCK, 1] pointers to each vector's first 32-bit word; LOW: where its second plane starts).
    A main-plane word holds F = 32 / W0 whole codes, coordinate F·j + f in field f of word j; the
    second plane holds the W1 high bits of coordinate d at bit d·W1. The words are taken apart
    as [BLOCK, words, F] by shifts and read as [BLOCK, CHUNK] in coordinate order, so a chunk reads
    only its own words. start is a multiple of 32 coordinates (a whole second-plane word)."""
    F: tl.constexpr = 32 // W0
    C: tl.constexpr = CHUNK // F
    j = tl.arange(0, C)
    f = tl.arange(0, F)
    main = tl.load(row + (start // F + j)[None, :], mask=ok[:, None], other=0)  # [BLOCK, C]
    code = (main[:, :, None] >> (f * W0)[None, None, :]) & ((1 << W0) - 1)  # [BLOCK, C, F]
    if W1 > 0:
        R: tl.constexpr = W0 // W1  # main words a second-plane word covers
        low = tl.load(row + LOW + ((start // F + j) // R)[None, :], mask=ok[:, None], other=0)
        shift = ((j % R) * (32 // R))[:, None] + (f * W1)[None, :]  # [C, F]
        code = code | (((low[:, :, None] >> shift[None, :, :]) & ((1 << W1) - 1)) << W0)
    return tl.reshape(code, (row.shape[0], CHUNK))


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
def key_scores(q_ptr, kw_ptr, ks_ptr, kl_ptr, kpos_ptr, pos_ptr, s_ptr, S, kv_heads, groups, row_words,
               query_scale, window,
               D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
               CHUNK: tl.constexpr, DOT: tl.constexpr):
    """Scores [T·K, groups, S] (float32) of one query row's heads of one KV head against a block of
    slots: the keys' levels computed from their codes a chunk of coordinates at a time and
    multiplied with the query's, then scaled by each key's scale; unseen slots at -3e38."""
    row_head = tl.program_id(0)  # t · kv_heads + head
    block = tl.program_id(1)
    t = row_head // kv_heads
    head = row_head % kv_heads
    slots = block * BLOCK + tl.arange(0, BLOCK)
    ok = slots < S
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    c = tl.arange(0, CHUNK)
    row = kw_ptr + ((slots * kv_heads + head) * row_words)[:, None]
    acc = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    # An 8-bit plane is int8's alone (kv_modes.code_planes): its bytes wrap to signed values.
    for start in tl.static_range(0, D, CHUNK):
        k = _level(_codes(row, ok, start, W0, W1, D * W0 // 32, CHUNK), kl_ptr, W0 == 8, DOT)  # [BLOCK, CHUNK]
        q = tl.load(q_ptr + (row_head * groups + g[:, None]) * D + (start + c)[None, :], mask=g_ok[:, None],
                    other=0.0)
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
    """One share of the slots' values, weighted, for one chunk of coordinates: [T·K, shares,
    groups, D] (float32), a program to a query row and KV head, a share of the slots and a chunk.
    The weights (the softmax, normalized) come from key_scores; each value is scaled before the
    product."""
    row_head = tl.program_id(0)
    share = tl.program_id(1)
    start = tl.program_id(2) * CHUNK
    head = row_head % kv_heads
    g = tl.arange(0, GROUPS)
    g_ok = g < groups
    c = tl.arange(0, CHUNK)
    acc = tl.zeros((GROUPS, CHUNK), dtype=tl.float32)
    first = share * per_share
    for offset in range(0, per_share, BLOCK):
        slots = first + offset + tl.arange(0, BLOCK)
        ok = slots < S
        w = tl.load(w_ptr + (row_head * groups + g[:, None]) * S + slots[None, :], mask=g_ok[:, None] & ok[None, :],
                    other=0.0)
        scale = tl.load(vs_ptr + slots * kv_heads + head, mask=ok, other=0.0).to(tl.float32)
        row = vw_ptr + ((slots * kv_heads + head) * row_words)[:, None]
        v = _level(_codes(row, ok, start, W0, W1, D * W0 // 32, CHUNK), vl_ptr, W0 == 8, tl.float32)
        # the scale on the value, not the weight: a weight times a small scale would fall below
        # float16's normal range where long caches spread their weights thin
        acc += tl.dot(w.to(DOT), (v * scale[:, None]).to(DOT))
    tl.store(out_ptr + ((row_head * shares + share) * groups + g[:, None]) * D + (start + c)[None, :], acc,
             mask=g_ok[:, None])
