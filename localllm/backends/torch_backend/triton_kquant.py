"""Decode GEMVs for the k-quants a Q4_K_M file is made of (Q4_K, Q5_K, Q6_K), one super-block of 256
values per row and step, in the blocks' own byte order: each program reads a row's 128 bytes of low
bits as one contiguous (4, 32) tile (wide loads), its scales once per super-block, and the x values
those bytes pair with (x is read from cache by every program). The values multiplied are formed as
quant/ggml.py forms them (see triton_quant.py on why they are bit-equal); a program owns BLOCK_N rows
of a range of super-blocks for one x row, and its partial sums go to out[split, row] (added by the
caller).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_k4_kernel(x_ptr, out_ptr, dm_ptr, scm_ptr, qh_ptr, qs_ptr, N, nb, stride_xm, blocks_per_split,
                   FIVE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Q4_K (FIVE False; qh_ptr unused) and Q5_K. Chunk c of a super-block's qs holds sub-block 2c in
    its low nibbles and 2c+1 in its high ones: values 64c + l and 64c + 32 + l."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.minimum(rn, N - 1).to(tl.int64)
    x_ptr += tl.program_id(2) * stride_xm  # grid: (row tiles, splits, x rows)
    c = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    acc = tl.zeros((BLOCK_N, 4, 32), dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    for blk in range(first, tl.minimum(nb, first + blocks_per_split)):
        b = n * nb + blk
        b3 = b[:, None, None]
        q = tl.load(qs_ptr + b3 * 128 + c * 32 + lane).to(tl.int32)
        lo, hi = q & 15, q >> 4
        if FIVE:  # bit s of qh byte l is the fifth bit of sub-block s's value l
            h = tl.load(qh_ptr + b3 * 32 + lane).to(tl.int32)
            lo = lo | (((h >> (2 * c)) & 1) << 4)
            hi = hi | (((h >> (2 * c + 1)) & 1) << 4)
        d = tl.load(dm_ptr + 2 * b).to(tl.float32)[:, None, None]
        dmin = tl.load(dm_ptr + 2 * b + 1).to(tl.float32)[:, None, None]
        s = scm_ptr + b3 * 16 + 2 * c  # scales of sub-blocks 2c, 2c+1; their mins 8 bytes on
        w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32) - dmin * tl.load(s + 8).to(tl.float32)
        w_hi = (d * tl.load(s + 1).to(tl.float32)) * hi.to(tl.float32) - dmin * tl.load(s + 9).to(tl.float32)
        xs = x_ptr + blk * 256 + c * 64 + lane
        acc += w_lo * tl.load(xs) + w_hi * tl.load(xs + 32)
    out = out_ptr + (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * N + rn
    tl.store(out, tl.sum(tl.sum(acc, axis=2), axis=1), mask=rn < N)


@triton.jit
def gemv_q6k_kernel(x_ptr, out_ptr, d_ptr, sc_ptr, qh_ptr, ql_ptr, N, nb, stride_xm, blocks_per_split,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """Q6_K. Row i = 2 * half + g of a super-block's ql: its low nibbles are run g of that half (values
    128 half + 32 g + l), its high ones run g + 2; the runs' top two bits are crumbs g and g + 2 of
    qh byte 32 half + l; one signed scale per 16 values."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.minimum(rn, N - 1).to(tl.int64)
    x_ptr += tl.program_id(2) * stride_xm  # grid: (row tiles, splits, x rows)
    i = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    half, g = i // 2, i % 2
    acc = tl.zeros((BLOCK_N, 4, 32), dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    for blk in range(first, tl.minimum(nb, first + blocks_per_split)):
        b = n * nb + blk
        b3 = b[:, None, None]
        ql = tl.load(ql_ptr + b3 * 128 + i * 32 + lane).to(tl.int32)
        qh = tl.load(qh_ptr + b3 * 64 + half * 32 + lane).to(tl.int32)
        lo = ((ql & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32
        hi = ((ql >> 4) | (((qh >> (2 * g + 4)) & 3) << 4)) - 32
        d = tl.load(d_ptr + b).to(tl.float32)[:, None, None]
        s = sc_ptr + b3 * 16 + half * 8 + g * 2 + lane // 16
        w_lo = (d * tl.load(s).to(tl.float32)) * lo.to(tl.float32)
        w_hi = (d * tl.load(s + 4).to(tl.float32)) * hi.to(tl.float32)
        xs = x_ptr + blk * 256 + half * 128 + g * 32 + lane
        acc += w_lo * tl.load(xs) + w_hi * tl.load(xs + 64)
    out = out_ptr + (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * N + rn
    tl.store(out, tl.sum(tl.sum(acc, axis=2), axis=1), mask=rn < N)
