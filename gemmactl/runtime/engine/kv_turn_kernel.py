"""The Triton kernel of kv_turn.py (imported only where Triton is: it ships with torch's CUDA
wheels). See kv_turn.py for what it computes, and kv.py for the layout of the codes."""

import triton
import triton.language as tl


@triton.jit
def _pack_store(code, base, start, ok, W0: tl.constexpr, W1: tl.constexpr, D: tl.constexpr,
                ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Store codes [ROWS, CHUNK] of coordinates start .. start + CHUNK in kv.py's planes (TurboKVCache._pack):
    the main plane's W0 low bits, F = 8 / W0 fields a byte (coordinate F·b + f at bit f·W0 of byte b),
    then the second plane's W1 high bits from byte D·W0 / 8 on. base: [ROWS] byte pointers to each
    vector's codes; ok: [ROWS] rows that store."""
    F: tl.constexpr = 8 // W0
    part = tl.reshape(code & ((1 << W0) - 1), (ROWS, CHUNK // F, F))
    byte = tl.sum(part << (tl.arange(0, F) * W0)[None, None, :], axis=2)
    b = tl.arange(0, CHUNK // F)
    tl.store(base[:, None] + (start // F + b)[None, :], byte.to(tl.uint8), mask=ok[:, None])
    if W1 > 0:
        G: tl.constexpr = 8 // W1
        high = tl.reshape((code >> W0) & ((1 << W1) - 1), (ROWS, CHUNK // G, G))
        byte = tl.sum(high << (tl.arange(0, G) * W1)[None, None, :], axis=2)
        b = tl.arange(0, CHUNK // G)
        tl.store(base[:, None] + (D * W0 // 8 + start // G + b)[None, :], byte.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _codes(u, edge_ptr, EDGES: tl.constexpr):
    """Codes of u [ROWS, CHUNK] (coordinates over their vector's scale): how many of the EDGES
    boundaries between levels lie below each, as torch.bucketize counts them."""
    code = tl.zeros(u.shape, dtype=tl.int32)
    for e in tl.static_range(EDGES):  # unrolled, so the edges' loads need not wait on each other
        code += (u > tl.load(edge_ptr + e)).to(tl.int32)
    return code


@triton.jit
def turned_write(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, sign_ptr, h_ptr, ke_ptr, ve_ptr, kcode_ptr, vcode_ptr,
                 kscale_ptr, vscale_ptr, slot_ptr, at_ptr, pos_ptr, out_ptr, rows, heads, kv_heads, slots, inv_root,
                 D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, PART: tl.constexpr,
                 KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                 K_EDGES: tl.constexpr, V_EDGES: tl.constexpr, STAGES: tl.constexpr):
    """A block of ROWS vectors and a chunk of CHUNK coordinates of their turned values. The vectors
    of a step's T tokens are taken in order: each token's N query heads, then its K keys, then its K
    values (rows = T·(N + 2K)). Each is turned, y = ((x - centre) · signs) H / sqrt(D) with H the
    ±1 Hadamard matrix, by two float16 products on tensor cores (the vector's float16 part and the
    float16 part of what that leaves, each exact against H's ±1, summed in float32: about 22 bits of
    the vector's mantissa), PART coordinates of the contraction at a time in a loop Triton pipelines
    (STAGES parts in flight). A query's chunk is stored turned (float32); a key's or value's chunk
    is quantized against its scale (the vector's RMS, which the rotation keeps, as float16) and its
    codes stored at the token's slot; the first chunk's program stores the scale and the slot's
    position (at_ptr: the tokens' positions)."""
    block = tl.program_id(0)
    start = tl.program_id(1) * CHUNK
    r = block * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    per = heads + 2 * kv_heads
    t = r // per
    j = r % per
    is_q = ok & (j < heads)
    is_k = ok & (j >= heads) & (j < heads + kv_heads)
    is_v = ok & (j >= heads + kv_heads)
    head = tl.where(is_q, j, tl.where(is_k, j - heads, j - heads - kv_heads))
    # One pointer a row (its tensor's, all of one dtype) and one centre (none for a query): two loads
    # a part, in a loop. The kernel's earlier form loaded each tensor masked to its rows (five loads
    # a part) with the parts unrolled, and Triton's sm_90 build held them all at once: 255
    # registers a thread, 696 and 2,184 bytes spilled at 256 and 512 wide. This one holds 130 at
    # the default tile, none spilled (benchmarks/kv_kernels_sm90.py).
    src = tl.where(is_q, q_ptr + (t * heads + head) * D,
                   tl.where(is_k, k_ptr + (t * kv_heads + head) * D, v_ptr + (t * kv_heads + head) * D))
    centre = tl.where(is_k, kc_ptr, vc_ptr) + head * D
    centred = ok & ~is_q
    c = tl.arange(0, CHUNK)
    p = tl.arange(0, PART)
    acc = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    squares = tl.zeros((ROWS,), dtype=tl.float32)
    for part in tl.range(0, D, PART, num_stages=STAGES):
        d = (part + p)[None, :]
        x = tl.load(src[:, None] + d, mask=ok[:, None], other=0.0).to(tl.float32) \
            - tl.load(centre[:, None] + d, mask=centred[:, None], other=0.0)
        squares += tl.sum(x * x, axis=1)
        x = x * tl.load(sign_ptr + part + p)[None, :]
        high = x.to(tl.float16)
        low = (x - high.to(tl.float32)).to(tl.float16)
        h = tl.load(h_ptr + (part + p)[:, None] * D + (start + c)[None, :])  # [PART, CHUNK] of ±1 (float16)
        acc = tl.dot(high, h, acc)
        acc = tl.dot(low, h, acc)
    y = acc * inv_root
    tl.store(out_ptr + (t * heads + head)[:, None] * D + (start + c)[None, :], y, mask=is_q[:, None])
    # Rounded as torch rounds (sqrt and division correctly rounded; 1/D exact, D a power of two):
    # the GPU's fast forms could put a coordinate on an edge in another level than the torch write.
    scale = tl.sqrt_rn(squares * (1.0 / D)).to(tl.float16)
    safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
    u = tl.div_rn(y, safe[:, None])
    slot = tl.load(slot_ptr + t, mask=ok, other=0)
    inside = slot < slots  # never past the cache (torch's write raises there; a kernel would write on: skipped)
    is_k = is_k & inside
    is_v = is_v & inside
    at = slot * kv_heads + head
    _pack_store(_codes(u, ke_ptr, K_EDGES), kcode_ptr + at * (D * (KW0 + KW1) // 8), start, is_k, KW0, KW1, D,
                ROWS, CHUNK)
    _pack_store(_codes(u, ve_ptr, V_EDGES), vcode_ptr + at * (D * (VW0 + VW1) // 8), start, is_v, VW0, VW1, D,
                ROWS, CHUNK)
    if start == 0:
        tl.store(kscale_ptr + at, scale, mask=is_k)
        tl.store(vscale_ptr + at, scale, mask=is_v)
        first = ok & inside & (j == 0)  # a token's first row stores its position
        tl.store(pos_ptr + slot, tl.load(at_ptr + t, mask=first, other=0), mask=first)
