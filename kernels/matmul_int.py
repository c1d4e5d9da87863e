"""Integer matmul tiles: packed weights (see packing.py) times int8-quantized activations.

One call handles one tile of TILE_ROWS weight rows for every activation row; the tile's bytes
stay in L1 while they are reused for all T rows.  Per activation row there are two phases:
  1. integer sums for every 32-block and lane (row), into int16/int32 arrays (nb, R);
  2. the float scale step, acc[r] += dsc[b, r] * dx[b] * sum + msc[b, r] * sx[b].
Why this shape (each point measured; getting it wrong costs 3-10x):
  * The lane (row) loop is innermost with the 16 quants of a block unrolled inside it, so LLVM
    vectorises across rows: one 16-byte load feeds 16 rows, and no horizontal sums are needed.
  * Phase 1 holds only int16 values, so LLVM picks 16-lane vectors; any float or int32 in the same
    loop makes it pick 8 lanes for everything (half speed).
  * Kernels take whole-tile views (q3 = qs[t], xr = x8[ti]) created once per tile: a view per
    block costs reference-count updates, and 4-D indexing inside the hot loop stopped LLVM from
    unrolling the quant loop (it vectorised it with gathers instead: 5x slower).
Overflow: |x8| <= 127 and 4-bit quants <= 15, so 16 products sum to <= 30480 < 2**15.
fastmath is safe: integer math is exact; it only reorders the float scale step.
"""

from __future__ import annotations

from numba import njit, types
from numba.extending import overload

from .packing import TILE_ROWS as R
from .simd import add16, add32, f16_to_f32, f32, i16, i32, mul16, mul32
from .simd_x86 import (
    HAVE_AVX2,
    crumb_sums_avx2,
    q4_block_sums_avx2,
    q4_block_sums_split_avx2,
    q4_pair_sums_avx2,
    q4_unpack_pairs_avx2,
    q8_block_sums16_avx2,
    q8_block_sums_avx2,
)
from .simd_x512 import (
    BIT_TABLES,
    HAVE_AVX512,
    HAVE_VNNI,
    crumb_sums_avx512,
    q4_block_sums_avx512,
    q4_block_sums_split_avx512,
    q4_pair_sums_avx512,
    q4_unpack_pairs_avx512,
    q5_bit_tables_avx512,
    q5_high_sums_avx512,
    q8_block_sums16_avx512,
    q8_block_sums16_vnni,
    q8_block_sums_vnni,
)

# Up to this many rows, each row takes the direct nibble kernel rather than the unpack-once one
# (with AVX-512 the direct kernel costs ~185 instructions a block, unpacking ~260 plus ~200 a row).
DIRECT_ROWS = 4 if HAVE_AVX512 else 1
# int16 entries of one activation row's fifth-bit tables per 32-block (see high_bit_sums_tables).
BIT_TABLE_LEN = BIT_TABLES * 32 if HAVE_AVX512 else 0

# Activation rows whose integer sums are computed together (see nibble_sums_rows): their int16
# sums, (ROW_CHUNK, nb, R) x 2, stay in L2.
ROW_CHUNK = 16


def nibble_sums(q3, xr, slo, shi) -> None:
    """For every block b and lane r, two int16 partial sums with slo + shi = the block's
    sum_j lo(q[b, j, r]) * x[32b + j] + hi(q[b, j, r]) * x[32b + 16 + j].
    q3 (nb, 16, R) uint8, xr (K,) int8 interleaved per block (quantize_act's x8p: x[32b + j] at
    32b + 2j, x[32b + 16 + j] at 32b + 2j + 1), slo/shi (nb, R) int16.  (Numba only: AVX2 IR kernel where
    the CPU has it, else `nibble_sums_portable`.)"""
    raise NotImplementedError


@overload(nibble_sums, jit_options={"cache": True})
def _nibble_sums_impl(q3, xr, slo, shi):
    if HAVE_AVX2:
        block = q4_block_sums_avx512 if HAVE_AVX512 else q4_block_sums_avx2

        def simd(q3, xr, slo, shi):
            q, x, s0, s1 = q3.ctypes.data, xr.ctypes.data, slo.ctypes.data, shi.ctypes.data
            for b in range(q3.shape[0]):
                block(q + b * 16 * R, x + b * 32, s0 + b * 2 * R, s1 + b * 2 * R)

        return simd
    return lambda q3, xr, slo, shi: nibble_sums_portable(q3, xr, slo, shi, True)


def nibble_sums_split(q3, xr, slo, shi) -> None:
    """Like nibble_sums, but slo is exactly the low nibbles' sum and shi the high nibbles'
    (Q6_K scales the two halves of a block differently).  (Numba only.)"""
    raise NotImplementedError


@overload(nibble_sums_split, jit_options={"cache": True})
def _nibble_sums_split_impl(q3, xr, slo, shi):
    if HAVE_AVX2:
        return _block_loop(q4_block_sums_split_avx512 if HAVE_AVX512 else q4_block_sums_split_avx2, 16)
    return lambda q3, xr, slo, shi: nibble_sums_portable(q3, xr, slo, shi, False)


def _block_loop(block, q_rows):
    """A loop calling block (q, x, s0, s1) for every 32-block of q3 (nb, q_rows, R) uint8 and plain
    int8 x, into int16 sums (nb, R)."""

    def loop(q3, xr, slo, shi):
        q, x, s0, s1 = q3.ctypes.data, xr.ctypes.data, slo.ctypes.data, shi.ctypes.data
        for b in range(q3.shape[0]):
            block(q + b * q_rows * R, x + b * 32, s0 + b * 2 * R, s1 + b * 2 * R)

    return loop


def nibble_sums_rows(q3, x8, t0, t1, slo, shi, pairs) -> None:
    """nibble_sums for activation rows t0..t1-1 of x8 into slo[i - t0] / shi[i - t0] (the same
    integer sums), unpacking each weight block once for all the rows.  pairs: PAIRS_BYTES uint8
    scratch.  (Numba only; without AVX2 it calls nibble_sums per row.)"""
    raise NotImplementedError


@overload(nibble_sums_rows, jit_options={"cache": True})
def _nibble_sums_rows_impl(q3, x8, t0, t1, slo, shi, pairs):
    if HAVE_AVX2:
        unpack = q4_unpack_pairs_avx512 if HAVE_AVX512 else q4_unpack_pairs_avx2
        pair_sums = q4_pair_sums_avx512 if HAVE_AVX512 else q4_pair_sums_avx2

        def simd(q3, x8, t0, t1, slo, shi, pairs):
            q, p, x = q3.ctypes.data, pairs.ctypes.data, x8.ctypes.data
            k, s0, s1 = x8.shape[1], slo.ctypes.data, shi.ctypes.data
            row = slo.shape[1] * R * 2  # bytes of one row's sums
            for b in range(q3.shape[0]):
                unpack(q + b * 16 * R, p)
                for ti in range(t0, t1):
                    o = (ti - t0) * row + b * 2 * R
                    pair_sums(p, x + ti * k + b * 32, s0 + o, s1 + o)

        return simd

    def portable(q3, x8, t0, t1, slo, shi, pairs):
        for ti in range(t0, t1):
            nibble_sums(q3, x8[ti], slo[ti - t0], shi[ti - t0])

    return portable


@njit(cache=True, fastmath=True, error_model="numpy")
def nibble_sums_portable(q3, xr, slo, shi, interleaved) -> None:
    """nibble_sums (interleaved x) or nibble_sums_split (plain x) in plain Numba: slo sums the low
    nibbles' products, shi the high ones'."""
    for b in range(q3.shape[0]):
        xo = b * 32
        for r in range(R):
            lo = i16(0)
            hi = i16(0)
            for j in range(16):
                q = i16(q3[b, j, r])
                il, ih = (xo + 2 * j, xo + 2 * j + 1) if interleaved else (xo + j, xo + 16 + j)
                xl, xh = xr[il], xr[ih]
                lo = add16(lo, mul16(i16(q & 15), i16(xl)))
                hi = add16(hi, mul16(i16(q >> 4), i16(xh)))
            slo[b, r] = lo
            shi[b, r] = hi


@njit(cache=True, fastmath=True, error_model="numpy")
def high_bit_sums(qh3, xr, sh) -> None:
    """sh[b, r] = sum of x over the block's elements whose fifth bit is set (|sum| <= 4064).
    qh3 (nb, 2, R) uint16: bit j of word 0 is element j, of word 1 element 16 + j."""
    for b in range(qh3.shape[0]):
        xo = b * 32
        for r in range(R):
            h0 = i16(qh3[b, 0, r])
            h1 = i16(qh3[b, 1, r])
            s = i16(0)
            for j in range(16):
                s = add16(s, mul16(i16((h0 >> j) & 1), i16(xr[xo + j])))
                s = add16(s, mul16(i16((h1 >> j) & 1), i16(xr[xo + 16 + j])))
            sh[b, r] = s


def bit_tables(x8, bits) -> None:
    """bits[t] = the fifth-bit lookup tables of activation row x8[t] (plain int8 order), BIT_TABLE_LEN
    int16 per 32-block; nothing where BIT_TABLE_LEN is 0 or bits has no columns.  (Numba only.)"""
    raise NotImplementedError


@overload(bit_tables, jit_options={"cache": True})
def _bit_tables_impl(x8, bits):
    if HAVE_AVX512:

        def avx512(x8, bits):
            if bits.shape[1] == 0:
                return
            for t in range(x8.shape[0]):
                x, tb = x8[t].ctypes.data, bits[t].ctypes.data
                for b in range(x8.shape[1] // 32):
                    q5_bit_tables_avx512(x + b * 32, tb + b * BIT_TABLE_LEN * 2)

        return avx512
    return lambda x8, bits: None


def high_bit_sums_tables(qh3, xr, tables, sh) -> None:
    """high_bit_sums, from xr's bit_tables where the CPU has AVX-512 (the same int16 sums).
    (Numba only.)"""
    raise NotImplementedError


@overload(high_bit_sums_tables, jit_options={"cache": True})
def _high_bit_sums_tables_impl(qh3, xr, tables, sh):
    if HAVE_AVX512:

        def avx512(qh3, xr, tables, sh):
            q, tb, s = qh3.ctypes.data, tables.ctypes.data, sh.ctypes.data
            for b in range(qh3.shape[0]):
                q5_high_sums_avx512(q + b * 4 * R, tb + b * BIT_TABLE_LEN * 2, s + b * 2 * R, 0)

        return avx512
    return lambda qh3, xr, tables, sh: high_bit_sums(qh3, xr, sh)


def crumb_sums(q3, xr, slo, shi) -> None:
    """crumb_sums_portable's sums for q3 = qh2, by an AVX-512 / AVX2 IR kernel where the CPU has
    one.  (Numba only.)"""
    raise NotImplementedError


@overload(crumb_sums, jit_options={"cache": True})
def _crumb_sums_impl(q3, xr, slo, shi):
    if HAVE_AVX2:
        return _block_loop(crumb_sums_avx512 if HAVE_AVX512 else crumb_sums_avx2, 8)
    return lambda q3, xr, slo, shi: crumb_sums_portable(q3, xr, slo, shi)


@njit(cache=True, fastmath=True, error_model="numpy")
def crumb_sums_portable(qh2, xr, slo, shi) -> None:
    """Q6_K's 2-bit high parts: byte j of qh2[b, :, r] holds elements j, j+8, j+16, j+24 (bits 0-1,
    2-3, 4-5, 6-7); slo sums the first 16 elements' crumb * x, shi the last 16 (<= 6096)."""
    for b in range(qh2.shape[0]):
        xo = b * 32
        for r in range(R):
            lo = i16(0)
            hi = i16(0)
            for j in range(8):
                c = i16(qh2[b, j, r])
                lo = add16(lo, mul16(i16(c & 3), i16(xr[xo + j])))
                lo = add16(lo, mul16(i16((c >> 2) & 3), i16(xr[xo + 8 + j])))
                hi = add16(hi, mul16(i16((c >> 4) & 3), i16(xr[xo + 16 + j])))
                hi = add16(hi, mul16(i16((c >> 6) & 3), i16(xr[xo + 24 + j])))
            slo[b, r] = lo
            shi[b, r] = hi


def q8_sums(q4, xr, s32) -> None:
    """s32[b, r] = sum_e q[b, r, e] * x[32b + e] for Q8_0's quad layout q4 (nb, 8, R, 4) int8 and
    int8 activations, or int16 ones (quantize_rows16, for linear_precise).
    (Numba only: AVX-512 / AVX2 IR kernel where the CPU has it, else `q8_sums_portable`.)"""
    raise NotImplementedError


@overload(q8_sums, jit_options={"cache": True})
def _q8_sums_impl(q4, xr, s32):
    if HAVE_AVX2:
        wide = xr.dtype == types.int16
        block = q8_block_sums16_avx2 if wide else q8_block_sums_avx2
        if wide and HAVE_AVX512:
            block = q8_block_sums16_vnni if HAVE_VNNI else q8_block_sums16_avx512
        elif HAVE_VNNI:
            block = q8_block_sums_vnni
        x_bytes = 64 if wide else 32  # one 32-block of activations

        def avx2(q4, xr, s32):
            q, x, s = q4.ctypes.data, xr.ctypes.data, s32.ctypes.data
            for b in range(q4.shape[0]):
                block(q + b * 32 * R, x + b * x_bytes, s + b * 4 * R, 0)

        return avx2
    return lambda q4, xr, s32: q8_sums_portable(q4, xr, s32)


@njit(cache=True, fastmath=True, error_model="numpy")
def q8_sums_portable(q4, xr, s32) -> None:
    """q8_sums in plain Numba, int32 products (|sum| <= 32 * 128 * 32767 even for int16 x)."""
    for b in range(q4.shape[0]):
        xo = b * 32
        for r in range(R):
            s = i32(0)
            for g in range(8):
                for e in range(4):
                    s = add32(s, mul32(i32(q4[b, g, r, e]), i32(xr[xo + 4 * g + e])))
            s32[b, r] = s


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_nibbles(q3, qh3, x8, x8p, bits, dx, sx, dsc, msc, acc, s16, pairs) -> None:
    """Q4_0/Q4_1/Q4_K and, with a non-empty qh3, Q5_0/Q5_1/Q5_K: w = dsc * q + msc per 32-block,
    q = nibble (+ 16 * fifth bit); dsc/msc (nb, R) from blockscales.
    sum_j w_j x_j = dsc * dx * sum_j(q_j x8_j) + msc * sx.
    bits: x8's bit_tables (five-bit kinds).  s16 (4, ROW_CHUNK, nb, R) int16 scratch.  A few rows
    take the direct kernel, more rows the unpack-once one; both give the same integer sums, and
    the float step below is shared, so a row's result does not depend on how many rows came with it."""
    five = qh3.shape[0] > 0
    slo, shi, sh = s16[0], s16[1], s16[2, 0]
    for t0 in range(0, x8.shape[0], ROW_CHUNK):
        t1 = min(x8.shape[0], t0 + ROW_CHUNK)
        if t1 - t0 <= DIRECT_ROWS:
            for ti in range(t0, t1):
                nibble_sums(q3, x8p[ti], slo[ti - t0], shi[ti - t0])
        else:
            nibble_sums_rows(q3, x8p, t0, t1, slo, shi, pairs)
        for ti in range(t0, t1):
            if five:
                high_bit_sums_tables(qh3, x8[ti], bits[ti], sh)
            _scale_nibbles(slo[ti - t0], shi[ti - t0], sh, five, dx[ti], sx[ti], dsc, msc, acc[ti])


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _scale_nibbles(slo, shi, sh, five, dx, sx, dsc, msc, acc) -> None:
    for b in range(slo.shape[0]):
        dxb, sxb = dx[b], sx[b]
        for r in range(R):
            s = i32(slo[b, r]) + i32(shi[b, r])
            if five:
                s += 16 * i32(sh[b, r])
            acc[r] += dsc[b, r] * dxb * f32(s) + msc[b, r] * sxb


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_q8_0(d, q3, x8, dx, acc, s32) -> None:
    """w = d * q.  d (nb, R) fp16 bits, q3 (nb, 8, R, 4) int8 quads; x8 int8 or int16 rows."""
    for ti in range(x8.shape[0]):
        q8_sums(q3, x8[ti], s32)
        for b in range(q3.shape[0]):
            dxb = dx[ti, b]
            for r in range(R):
                acc[ti, r] += f16_to_f32(d[b, r]) * dxb * f32(s32[b, r])


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_q6_k(d, sc, qh2, q3, x8, dx, hs, acc, s16) -> None:
    """w = d * sc16 * (q - 32), q = nibble + 16 * crumb, one int8 scale per 16 elements.
    d (ns, R) fp16 bits, sc (nb, 2, R) int8, qh2 (nb, 8, R), q3 (nb, 16, R)."""
    slo, shi, clo, chi = s16[0, 0], s16[1, 0], s16[2, 0], s16[3, 0]
    for ti in range(x8.shape[0]):
        nibble_sums_split(q3, x8[ti], slo, shi)
        crumb_sums(qh2, x8[ti], clo, chi)
        for b in range(q3.shape[0]):
            h0, h1 = 32 * hs[ti, 2 * b], 32 * hs[ti, 2 * b + 1]
            dxb = dx[ti, b]
            for r in range(R):
                lo = i32(slo[b, r]) + 16 * i32(clo[b, r]) - h0
                hi = i32(shi[b, r]) + 16 * i32(chi[b, r]) - h1
                s = f32(i32(sc[b, 0, r]) * lo + i32(sc[b, 1, r]) * hi)
                acc[ti, r] += f16_to_f32(d[b >> 3, r]) * dxb * s
