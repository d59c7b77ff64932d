"""The Triton kernels of runtime/engine/int4_gemv.py (imported only where one runs: Triton is not
needed to import the engine). Codes nibble-packed two to a byte, low nibble first; fp16 scale and
zero per group of GROUP columns; w = q·scale + zero."""

import triton
import triton.language as tl

@triton.jit
def _partial(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_ok, first, K, G, stride_q, stride_s, G_PER,
             BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2
    g_in = tl.arange(0, BLOCK_G)  # [BG]
    b_in = tl.arange(0, HALF)  # [g/2]: a group's bytes
    acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    for offset in range(0, G_PER, BLOCK_G):
        g = first + offset + g_in  # [BG] groups
        g_ok = g < G
        byte = g[:, None] * HALF + b_in[None, :]  # [BG, g/2]
        even = byte * 2
        # The token's columns, even and odd (what the low and high nibbles multiply); zero past K.
        xe = tl.load(x_ptr + even, mask=g_ok[:, None] & (even < K), other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + even + 1, mask=g_ok[:, None] & (even + 1 < K), other=0.0).to(tl.float32)
        codes = tl.load(q_ptr + rows[:, None, None] * stride_q + byte[None, :, :],
                        mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)  # [BN, BG, g/2]
        lo = (codes & 15).to(tl.float32)
        hi = (codes >> 4).to(tl.float32)
        qx = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)  # [BN, BG]: Σ q·x per group
        xs = tl.sum(xe + xo, axis=1)  # [BG]: Σ x per group
        at = rows[:, None] * stride_s + g[None, :]
        ok = row_ok[:, None] & g_ok[None, :]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32)
        acc += scale * qx + zero * xs[None, :]
    return tl.sum(acc, axis=1)  # [BN]

@triton.jit
def int4_gemv(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K, G, stride_q, stride_s, G_PER,
              BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    total = _partial(x_ptr, q_ptr, s_ptr, z_ptr, rows, row_ok, tl.program_id(1) * G_PER, K, G, stride_q,
                     stride_s, G_PER, BLOCK_N, BLOCK_G, GROUP)
    tl.store(y_ptr + tl.program_id(1) * N + rows, total.to(y_ptr.dtype.element_ty), mask=row_ok)

# MATRICES not specialized: one matrix (an eager step's expert) and a layer's k run the same binary,
# so each program's products are the same bits (runtime/engine/expert_arena.py, rows_forward).
@triton.jit(do_not_specialize=["MATRICES"])
def int4_gemv_grouped(x_ptr, stride_x, addr_ptr, y_ptr, N, K, G, stride_q, stride_s, G_PER, MATRICES,
                      BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    # Program (row block, matrix) on axis 0, K split on axis 1. addr_ptr: [M, 3] int64, the
    # matrix's codes, scales and zeros; x_ptr + m * stride_x: its token (stride_x 0: one shared).
    blocks = tl.cdiv(N, BLOCK_N)
    m = tl.program_id(0) // blocks
    rows = (tl.program_id(0) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # Each tensor is found from the output's address plus an offset promised to be a multiple of 16
    # bytes (every tensor the table names starts 16-byte aligned): Triton knows y_ptr's alignment,
    # so it reads the codes in vectors. A pointer made from a loaded integer carries no alignment,
    # and the codes were read a byte at a time (about a tenth of HBM's rate at 26B-A4B's experts).
    base = y_ptr.to(tl.pointer_type(tl.uint8))
    at = y_ptr.to(tl.int64)
    q_ptr = base + tl.multiple_of(tl.load(addr_ptr + m * 3) - at, 16)
    s_ptr = (base + tl.multiple_of(tl.load(addr_ptr + m * 3 + 1) - at, 16)).to(tl.pointer_type(tl.float16))
    z_ptr = (base + tl.multiple_of(tl.load(addr_ptr + m * 3 + 2) - at, 16)).to(tl.pointer_type(tl.float16))
    total = _partial(x_ptr + m * stride_x, q_ptr, s_ptr, z_ptr, rows, row_ok, tl.program_id(1) * G_PER, K, G,
                     stride_q, stride_s, G_PER, BLOCK_N, BLOCK_G, GROUP)
    tl.store(y_ptr + (tl.program_id(1) * MATRICES + m) * N + rows, total.to(y_ptr.dtype.element_ty),
             mask=row_ok)

@triton.jit
def int4_dequantize(q_ptr, s_ptr, z_ptr, w_ptr, N, K, G, stride_q, stride_s, stride_w,
                    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok, g_ok = rows < N, g < G
    byte = g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [BG, g/2]
    codes = tl.load(q_ptr + rows[:, None, None] * stride_q + byte[None, :, :],
                    mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
    at = rows[:, None] * stride_s + g[None, :]
    ok = row_ok[:, None] & g_ok[None, :]
    scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
    zero = tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
    even = byte * 2
    out = w_ptr + rows[:, None, None] * stride_w + even[None, :, :]
    keep = row_ok[:, None, None] & g_ok[None, :, None]
    tl.store(out, ((codes & 15).to(tl.float32) * scale + zero).to(w_ptr.dtype.element_ty),
             mask=keep & (even < K)[None, :, :])
    tl.store(out + 1, ((codes >> 4).to(tl.float32) * scale + zero).to(w_ptr.dtype.element_ty),
             mask=keep & (even + 1 < K)[None, :, :])

@triton.jit
def copy_rows(src_ptr, dst_ptr, flag_ptr, anchor_ptr, WORDS, PER, BLOCK: tl.constexpr):
    # Program (row m, stretch of PER words): copy row m's WORDS 32-bit words from the address at
    # src_ptr + m to the one at dst_ptr + m where flag_ptr + m is set (a pinned host row is read in
    # place over the link). Addresses are found from anchor_ptr plus offsets promised to be
    # multiples of 16 bytes, as int4_gemv_grouped finds its tensors, so the words move in vectors.
    m = tl.program_id(0)
    words = tl.where(tl.load(flag_ptr + m).to(tl.int32) != 0, WORDS, 0)  # nothing to move where unflagged
    at = anchor_ptr.to(tl.int64)
    src = anchor_ptr + tl.multiple_of((tl.load(src_ptr + m) - at) // 4, 4)
    dst = anchor_ptr + tl.multiple_of((tl.load(dst_ptr + m) - at) // 4, 4)
    first = tl.program_id(1) * PER
    for offset in range(0, PER, BLOCK):
        i = first + offset + tl.arange(0, BLOCK)
        ok = i < words
        tl.store(dst + i, tl.load(src + i, mask=ok), mask=ok)
