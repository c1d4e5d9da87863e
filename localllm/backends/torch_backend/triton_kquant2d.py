"""The k-quant GEMM (Q4_K, Q5_K, Q6_K) with 2-D tiles only: triton_kquant.gemm_kquant_kernel's values,
a super-block's 128 quant bytes per row taken as four (BLOCK_N, 32) chunks, each chunk's low and high
nibbles in their own tensor-core dot (eight dots of K = 32 a super-block instead of two of 128).

Why chunks: in a chunk every value shares its row's scale and min (Q6_K: one of two, by lane), so the
scales are (BLOCK_N, 1) loads broadcast along the chunk, and every operand of the values' arithmetic
is either the quant tile or a broadcast. Triton can then form the values directly in the dot's
operand layout (its sm_90 TTGIR reads the quant bytes from the pipelined shared-memory copy straight
into that layout): no float tile goes through shared memory and no barrier is left in the loop. The
default kernel builds (BLOCK_N, 128) values and stores them to shared memory for each dot (four
round trips a super-block with tf32x3), as does a (BLOCK_N, 128) 2-D tile whose scales are gathered
per column (the gathers cannot be re-laid out).

Byte 32 i + l of a super-block holds, for Q4_K/Q5_K, value 64 i + l (low nibble) and 64 i + l + 32
(high nibble); for Q6_K (ql row i = 2 half + g) value 128 half + 32 g + l and that + 64. Values are
formed in triton_kquant._weights' float32 operation order (bit-equal to quant/ggml.py's). Planes and
KIND as triton_kquant's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk(p0, p1, p2, p3, sb, i: tl.constexpr, KIND: tl.constexpr):
    """(w_lo, w_hi), (BN, 32) float32: bytes 32 i .. 32 i + 31 of super-blocks sb (BN, 1)."""
    lane = tl.arange(0, 32)[None, :]
    q = tl.load(p3 + sb * 128 + i * 32 + lane).to(tl.int32)
    if KIND == 2:  # runs g and g + 2 of half `half`, their top bits crumbs g and g + 2 of qh
        half: tl.constexpr = i // 2
        g: tl.constexpr = i % 2
        qh = tl.load(p2 + sb * 64 + half * 32 + lane).to(tl.int32)
        lo = ((q & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
        hi = ((q >> 4) | (((qh >> (2 * g + 4)) & 3) << 4)) - 32
        d = tl.load(p0 + sb).to(tl.float32)
        s = p1 + sb * 16 + half * 8 + g * 2  # one signed scale per 16 values: lanes 0-15, 16-31
        first = lane < 16
        s_lo = tl.where(first, d * tl.load(s).to(tl.float32), d * tl.load(s + 1).to(tl.float32))
        s_hi = tl.where(first, d * tl.load(s + 4).to(tl.float32), d * tl.load(s + 5).to(tl.float32))
        return s_lo * lo.to(tl.float32), s_hi * hi.to(tl.float32)
    lo, hi = q & 15, q >> 4
    if KIND == 1:  # bit s of qh byte l is the fifth bit of sub-block s's value l
        h = tl.load(p2 + sb * 32 + lane).to(tl.int32)
        lo = lo | (((h >> (2 * i)) & 1) << 4)
        hi = hi | (((h >> (2 * i + 1)) & 1) << 4)
    d = tl.load(p0 + 2 * sb).to(tl.float32)
    dmin = tl.load(p0 + 2 * sb + 1).to(tl.float32)
    s = p1 + sb * 16 + 2 * i  # the scales of sub-blocks 2i, 2i+1; their mins 8 bytes on
    w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32) - dmin * tl.load(s + 8).to(tl.float32)
    w_hi = (d * tl.load(s + 1).to(tl.float32)) * hi.to(tl.float32) - dmin * tl.load(s + 9).to(tl.float32)
    return w_lo, w_hi


@triton.jit
def _x_chunk(i: tl.constexpr, KIND: tl.constexpr):
    """(1, 32) offsets in a super-block of x of chunk i's low values, and how far on the high ones are."""
    lane = tl.arange(0, 32)[None, :]
    if KIND == 2:
        return (i // 2) * 128 + (i % 2) * 32 + lane, 64
    return i * 64 + lane, 32


@triton.jit(do_not_specialize=["blocks_per_split"])
def gemm_kquant2d_kernel(x_ptr, out_ptr, p0, p1, p2, p3, M, N, nb, stride_xm, blocks_per_split,
                         KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         STEP: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out[split, m, n] for a (BLOCK_M, BLOCK_N) tile, STEP super-blocks a loop step; grid (m tiles,
    n tiles, splits). Super-blocks past the split's end (in its last step) are read clamped, real
    ones, and meet x masked to zero."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (tl.minimum(rn, N - 1).to(tl.int64) * nb)[:, None]
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    last = tl.minimum(nb, first + blocks_per_split)
    for b0 in range(first, last, STEP):
        for s in tl.static_range(STEP):
            sb = row + tl.minimum(b0 + s, nb - 1)
            for i in tl.static_range(4):
                w_lo, w_hi = _chunk(p0, p1, p2, p3, sb, i, KIND)
                xo, hi_step = _x_chunk(i, KIND)
                x = xs + (b0 + s) * 256 + xo
                if STEP == 1:  # a step never passes the split's end
                    x_lo = tl.load(x)
                    x_hi = tl.load(x + hi_step)
                else:
                    x_lo = tl.load(x, mask=xo * 0 + b0 + s < last, other=0.0)
                    x_hi = tl.load(x + hi_step, mask=xo * 0 + b0 + s < last, other=0.0)
                acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
                acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    out = out_ptr + (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
