"""Matmuls for the k-quants a Q4_K_M file is made of (Q4_K, Q5_K, Q6_K), super-blocks of 256 values
per row and step, in the blocks' own byte order: a row's 128 bytes of low bits are one contiguous
(4, 32) tile (16-byte loads once pointers are aligned, as the JIT specializes them), its scales are
read once per super-block, and x is read at the positions those bytes hold.

Planes (weights.py), as p0..p3: Q4_K (dm, scm, qs, qs), Q5_K (dm, scm, qh, qs), Q6_K (d, scm, qh, qs).
KIND: 0 Q4_K, 1 Q5_K, 2 Q6_K. The GEMM forms values as quant/ggml.py forms them (triton_quant.py says
why they are bit-equal); the GEMV sums each scale's quants times x first and scales the sum (the
same products in another float32 order, as llama.cpp's decode kernels do). Each program owns a range
of super-blocks (split-K) and writes its partial sums to out[split] (the caller adds them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _weights(p0, p1, p2, p3, b, KIND: tl.constexpr):
    """Super-block b (BN,) of each row as (w_lo, w_hi), (BN, 4, 32) float32 each. Q4_K/Q5_K: qs chunk
    c holds sub-block 2c in its low nibbles, 2c+1 in its high ones. Q6_K: ql row i = 2 half + g holds
    run g of that half in its low nibbles, run g + 2 in its high ones, their top bits crumbs g and
    g + 2 of qh byte 32 half + l, one signed scale per 16 values."""
    b3 = b[:, None, None]
    i = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    q = tl.load(p3 + b3 * 128 + i * 32 + lane).to(tl.int32)
    if KIND == 2:
        half, g = i // 2, i % 2
        qh = tl.load(p2 + b3 * 64 + half * 32 + lane).to(tl.int32)
        lo = ((q & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
        hi = ((q >> 4) | (((qh >> (2 * g + 4)) & 3) << 4)) - 32
        d = tl.load(p0 + b).to(tl.float32)[:, None, None]
        s = p1 + b3 * 16 + half * 8 + g * 2 + lane // 16
        w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32)
        w_hi = (d * tl.load(s + 4).to(tl.float32)) * hi.to(tl.float32)
    else:
        lo, hi = q & 15, q >> 4
        if KIND == 1:  # bit s of qh byte l is the fifth bit of sub-block s's value l
            h = tl.load(p2 + b3 * 32 + lane).to(tl.int32)
            lo = lo | (((h >> (2 * i)) & 1) << 4)
            hi = hi | (((h >> (2 * i + 1)) & 1) << 4)
        d = tl.load(p0 + 2 * b).to(tl.float32)[:, None, None]
        dmin = tl.load(p0 + 2 * b + 1).to(tl.float32)[:, None, None]
        s = p1 + b3 * 16 + 2 * i  # the scales of sub-blocks 2i, 2i+1; their mins 8 bytes on
        w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32) - dmin * tl.load(s + 8).to(tl.float32)
        w_hi = (d * tl.load(s + 1).to(tl.float32)) * hi.to(tl.float32) - dmin * tl.load(s + 9).to(tl.float32)
    return w_lo, w_hi


@triton.jit
def _x_offsets(KIND: tl.constexpr):
    """(1, 4, 32) positions within a super-block of the values _weights' w_lo holds, and how far on
    w_hi's are."""
    i = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    if KIND == 2:
        return (i // 2) * 128 + (i % 2) * 32 + lane, 64
    return i * 64 + lane, 32


@triton.jit(do_not_specialize=["blocks_per_split"])  # one compile for any split size
def gemv_kquant_kernel(x_ptr, out_ptr, p0, p1, p2, p3, N, nb, stride_xm, blocks_per_split,
                       KIND: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr):  # fmt: skip
    """out[split, m, n] = this split's super-blocks of row n dotted with x row m, STEP super-blocks
    a loop step (unrolled: their loads are all in flight at once); grid (row tiles, splits, x rows)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(rn, N - 1).to(tl.int64) * nb
    xs = x_ptr + tl.program_id(2) * stride_xm
    acc = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    last = tl.minimum(nb, first + blocks_per_split)
    for b0 in range(first, last, STEP):
        for s in tl.static_range(STEP):
            b = row + tl.minimum(b0 + s, nb - 1)  # past the end: a real super-block, x masked to 0
            if KIND == 2:
                acc += _q6_k_dots(p0, p1, p2, p3, b, xs, b0 + s, last)
            else:
                acc += _k4_dots(p0, p1, p2, p3, b, xs, b0 + s, last, KIND == 1)
    out = out_ptr + (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * N + rn
    tl.store(out, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _magic(q, bias: tl.constexpr):
    """q - bias as float32 for int32 0 <= q < 2^23, exactly, without an int-to-float convert."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _k4_dots(p0, p1, p2, p3, b, xs, blk, last, FIVE: tl.constexpr):
    """(BN, 4): super-blocks b (BN,) of Q4_K/Q5_K times super-block blk of x (zero from `last` on),
    sub-blocks 2i and 2i+1 in column i, as (d * sc) * sum(q * x) - (dmin * m) * sum(x). Small
    tensors (scales, x) are loaded with fewer dimensions and broadcast: a load shaped like the quant
    tile but laid out otherwise would make Triton move the tile through shared memory."""
    i = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    q = tl.load(p3 + b[:, None, None] * 128 + i[None, :, None] * 32 + lane[None, None, :]).to(tl.int32)
    lo, hi = q & 15, q >> 4
    if FIVE:  # bit s of qh byte l is the fifth bit of sub-block s's value l
        h = tl.load(p2 + b[:, None] * 32 + lane[None, :]).to(tl.int32)[:, None, :]
        lo = lo | (((h >> (2 * i[None, :, None])) & 1) << 4)
        hi = hi | (((h >> (2 * i[None, :, None] + 1)) & 1) << 4)
    xo = i[:, None] * 64 + lane[None, :]
    xp = xs + blk * 256 + xo
    xm = (
        xo * 0 + blk < last
    )  # uniform per super-block (the loads stay wide); a tensor, as the interpreter wants
    x_lo = tl.load(xp, mask=xm, other=0.0)
    x_hi = tl.load(xp + 32, mask=xm, other=0.0)
    s_lo = tl.sum(_magic(lo, 0) * x_lo[None, :, :], axis=2)
    s_hi = tl.sum(_magic(hi, 0) * x_hi[None, :, :], axis=2)
    d = tl.load(p0 + 2 * b).to(tl.float32)[:, None]
    dmin = tl.load(p0 + 2 * b + 1).to(tl.float32)[:, None]
    sc = p1 + b[:, None] * 16 + 2 * i[None, :]  # the scales of sub-blocks 2i, 2i+1; their mins 8 on
    lo_part = (d * tl.load(sc).to(tl.float32)) * s_lo - (dmin * tl.load(sc + 8).to(tl.float32)) * tl.sum(
        x_lo, 1
    )
    hi_part = (d * tl.load(sc + 1).to(tl.float32)) * s_hi - (dmin * tl.load(sc + 9).to(tl.float32)) * tl.sum(
        x_hi, 1
    )
    return lo_part + hi_part


@triton.jit
def _q6_k_dots(p0, p1, p2, p3, b, xs, blk, last):
    """(BN, 4): super-blocks b (BN,) of Q6_K times super-block blk of x (zero from `last` on), as
    d * sc * sum(q * x) per 16 values; the tile is (BN, 4 ql rows, 2 scale groups, 16) so each
    scale meets its own sums."""
    i = tl.arange(0, 4)[:, None, None]
    grp = tl.arange(0, 2)[None, :, None]
    t = tl.arange(0, 16)[None, None, :]
    half, g = i // 2, i % 2
    b4 = b[:, None, None, None]
    q = tl.load(p3 + b4 * 128 + (i * 32 + grp * 16 + t)[None]).to(tl.int32)
    qh = tl.load(p2 + b4 * 64 + (half * 32 + grp * 16 + t)[None]).to(tl.int32)
    g4 = g[None]
    lo = (q & 15) | (((qh >> (2 * g4)) & 3) << 4)
    hi = (q >> 4) | (((qh >> (2 * g4 + 4)) & 3) << 4)
    xo = half * 128 + g * 32 + grp * 16 + t
    xp = xs + blk * 256 + xo
    xm = xo * 0 + blk < last
    s_lo = tl.sum(_magic(lo, 32) * tl.load(xp, mask=xm, other=0.0)[None], axis=3)
    s_hi = tl.sum(_magic(hi, 32) * tl.load(xp + 64, mask=xm, other=0.0)[None], axis=3)
    j = (tl.arange(0, 4)[:, None] // 2) * 8 + (tl.arange(0, 4)[:, None] % 2) * 2 + tl.arange(0, 2)[None, :]
    sc = p1 + b[:, None, None] * 16 + j[None]  # (BN, 4, 2): lo's scales; hi's 4 on
    part = tl.load(sc).to(tl.float32) * s_lo + tl.load(sc + 4).to(tl.float32) * s_hi
    return tl.load(p0 + b).to(tl.float32)[:, None] * tl.sum(part, axis=2)


@triton.jit(do_not_specialize=["blocks_per_split"])  # (x's offsets are multiples of 256 anyway)
def gemm_kquant_kernel(x_ptr, out_ptr, p0, p1, p2, p3, M, N, nb, stride_xm, blocks_per_split,
                       KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):  # fmt: skip
    """out[split, m, n] for a (BLOCK_M, BLOCK_N) tile: per super-block two tensor-core dots, the low
    and the high halves of its bytes against the x columns they pair with; grid (m tiles, n tiles,
    splits)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.minimum(rn, N - 1).to(tl.int64)
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None, None] * stride_xm
    off, hi_step = _x_offsets(KIND)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for blk in range(first, tl.minimum(nb, first + blocks_per_split)):
        w_lo, w_hi = _weights(p0, p1, p2, p3, n * nb + blk, KIND)
        x = xs + blk * 256 + off
        x_lo = tl.reshape(tl.load(x), (BLOCK_M, 128))
        x_hi = tl.reshape(tl.load(x + hi_step), (BLOCK_M, 128))
        acc = tl.dot(x_lo, tl.trans(tl.reshape(w_lo, (BLOCK_N, 128))), acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, tl.trans(tl.reshape(w_hi, (BLOCK_N, 128))), acc, input_precision=PRECISION)
    out = out_ptr + (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
