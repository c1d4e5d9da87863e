"""The k-quant GEMM (Q4_K, Q5_K, Q6_K) with 2-D tiles only: triton_kquant.gemm_kquant_kernel's values
and dots, without its (rows, 4, 32) tiles. That kernel reshapes 3-D tiles to (rows, 128) before each
dot, and every reshape or 3-D load laid out unlike its neighbours is a layout conversion through
shared memory; on an H200 it ran at ~18 TFLOP/s (64 rows), bound by its own instructions.

Here a step of STEP super-blocks is one (BLOCK_N, 128 * STEP) tile of quant bytes per row: a row's
super-blocks are contiguous in the qs plane, so column c is byte c of the row's step. Everything a
byte's values need (scale, min, Q5_K/Q6_K high bits, x) is loaded at per-column offsets computed from
c: the scale bytes are a 2-D gather from each row's 16 (L1-resident), x two (BLOCK_M, 128 * STEP)
tiles. Byte c % 128 = 32 i + l of a super-block holds, for Q4_K/Q5_K, value 64 i + l (low nibble)
and 64 i + l + 32 (high nibble); for Q6_K (ql row i = 2 half + g) value 128 half + 32 g + l and
that + 64. Values are formed in triton_kquant._weights' float32 operation order (bit-equal to
quant/ggml.py's). Planes and KIND as triton_kquant's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _values(p0, p1, p2, p3, sb, c, KIND: tl.constexpr):
    """(w_lo, w_hi), (BN, C) float32: super-blocks sb (BN, C), or (BN, 1) for one a row, at byte
    c % 128 (1, C) of each."""
    i = (c % 128) // 32
    lane = c % 32
    q = tl.load(p3 + sb * 128 + c % 128).to(tl.int32)
    if KIND == 2:
        half, g = i // 2, i % 2
        qh = tl.load(p2 + sb * 64 + half * 32 + lane).to(tl.int32)
        lo = ((q & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
        hi = ((q >> 4) | (((qh >> (2 * g + 4)) & 3) << 4)) - 32
        d = tl.load(p0 + sb).to(tl.float32)
        s = p1 + sb * 16 + half * 8 + g * 2 + lane // 16
        w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32)
        w_hi = (d * tl.load(s + 4).to(tl.float32)) * hi.to(tl.float32)
    else:
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
def _x_columns(c, KIND: tl.constexpr):
    """(1, C) offsets in x of the values w_lo holds at columns c (from the step's first value), and
    how far on w_hi's are."""
    i = (c % 128) // 32
    if KIND == 2:
        return (c // 128) * 256 + (i // 2) * 128 + (i % 2) * 32 + c % 32, 64
    return (c // 128) * 256 + i * 64 + c % 32, 32


@triton.jit(do_not_specialize=["blocks_per_split"])
def gemm_kquant2d_kernel(x_ptr, out_ptr, p0, p1, p2, p3, M, N, nb, stride_xm, blocks_per_split,
                         KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         STEP: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out[split, m, n] for a (BLOCK_M, BLOCK_N) tile, STEP super-blocks a loop step, each step's low
    and high halves in two tensor-core dots; grid (m tiles, n tiles, splits). Super-blocks past the
    split's end (its last step) are read clamped, real ones, and meet x masked to zero."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (tl.minimum(rn, N - 1).to(tl.int64) * nb)[:, None]
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    c = tl.arange(0, 128 * STEP)[None, :]
    xo, hi_step = _x_columns(c, KIND)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    last = tl.minimum(nb, first + blocks_per_split)
    for b0 in range(first, last, STEP):
        x = xs + b0 * 256 + xo
        if STEP == 1:  # one super-block per row: its scales are (BN, 1), and no step passes the end
            w_lo, w_hi = _values(p0, p1, p2, p3, row + b0, c, KIND)
            x_lo = tl.load(x)
            x_hi = tl.load(x + hi_step)
        else:
            blk = b0 + c // 128
            w_lo, w_hi = _values(p0, p1, p2, p3, row + tl.minimum(blk, nb - 1), c, KIND)
            x_lo = tl.load(x, mask=blk < last, other=0.0)
            x_hi = tl.load(x + hi_step, mask=blk < last, other=0.0)
        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    out = out_ptr + (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
