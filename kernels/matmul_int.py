"""Integer matmul tiles: packed weights (see packing.py) times int8-quantized activations.

One call handles one tile of TILE_ROWS weight rows for every activation row; the tile's bytes
stay in L1 while they are reused for all T rows.  Per activation row there are two phases:
  1. integer sums for every 32-block and lane (row), into int16/int32 arrays (nb, R);
  2. the float scale step, acc[r] += dsc[b, r] * dx[b] * sum + msc[b, r] * sx[b].
Why this shape (each point measured; getting one wrong cost several times the time):
  * The lane (row) loop is innermost with the 16 quants of a block unrolled inside it, so LLVM
    vectorises across rows: one 16-byte load feeds 16 rows, and no horizontal sums are needed.
  * Phase 1 holds only int16 values, so LLVM picks 16-lane vectors; any float or int32 in the same
    loop makes it pick 8 lanes for everything (half speed).
  * Kernels take whole-tile views (q3 = qs[t], xr = x8[ti]) created once per tile: a view per
    block costs reference-count updates, and 4-D indexing inside the hot loop stopped LLVM from
    unrolling the quant loop (it vectorised it with gathers instead, several times slower).
Overflow: |x8| <= 127 and 4-bit quants <= 15, so 16 products sum to <= 30480 < 2**15.
fastmath is safe for the integer phase (exact).  The float step is compiled with simd.EXACT_FP and
written-out FMAs: with reassociation its bits differed between a fresh compile and the disk cache.
"""

from __future__ import annotations

from numba import njit, types
from numba.extending import overload

from .packing import TILE_ROWS as R
from .simd import EXACT_FP, add16, add32, f16_to_f32, f32, fma_f32, i16, i32, mul16, mul32
from .simd_x86 import (
    HAVE_AVX2,
    crumb_sums_avx2,
    q4_block_sums_avx2,
    q4_block_sums_split_avx2,
    q4_pair_sums_avx2,
    q4_unpack_pairs_avx2,
    q8_block_sums16_avx2,
    q8_block_sums_avx2,
    q8_block_sums_avxvnni,
)
from .simd_x86_quads import (
    q4_quad_sums_avx2,
    q4_unpack_quads_avx2,
    q5_quad_sums_avx2,
    q5_unpack_quads_avx2,
    q6_quad_sums_avx2,
    q6_unpack_quads_avx2,
    quad_sums_avxvnni,
    quad_sums_split_avxvnni,
)
from .simd_x512 import (
    AVX2_ONLY,
    AVX2_VNNI,
    BIT_TABLES,
    HAVE_AVX512,
    HAVE_VNNI,
    crumb_sums_avx512,
    q4_block_sums_avx512,
    q4_block_sums_split_avx512,
    q4_pair_sums_avx512,
    q4_unpack_pairs_avx512,
    q4_unpack_quads_vnni,
    q5_bit_tables_avx512,
    q5_high_sums_avx512,
    q5_unpack_quads_vnni,
    q6_unpack_quads_vnni,
    q8_block_sums16_avx512,
    q8_block_sums16_vnni,
    q8_block_sums_vnni,
    quad_sums_split_vnni,
    quad_sums_vnni,
)
from .superblock import BLOCKS, k_step_five, k_step_pairs, k_step_sums

# Up to this many rows, each row takes the direct nibble kernel rather than the unpack-once one
# (with AVX-512 the direct kernel costs ~185 instructions a block, unpacking ~260 plus ~200 a row).
DIRECT_ROWS = 4 if HAVE_AVX512 else 1
# int16 entries of one activation row's fifth-bit tables per 32-block (see high_bit_sums_tables).
BIT_TABLE_LEN = BIT_TABLES * 32 if HAVE_AVX512 else 0

# Activation rows whose integer sums are computed together (see nibble_sums_rows): their int16
# sums, (ROW_CHUNK, nb, R) x 2, stay in L2.
ROW_CHUNK = 16
# With AVX512-VNNI, chunks of at least QUAD_ROWS (Q6_K: QUAD_ROWS_Q6) rows unpack each weight block
# once into quads (quad_sums_rows, q6_sums_rows) and every path hands the float step one int32 sum
# per block and row (two for Q6_K), from one place in the code: a row's bits never depend on its
# chunk's size.  QUAD_ROWS is where one tile's quad sums overtook the direct kernel's (Q6_K earlier:
# its direct kernel takes two passes a row); see docs/benchmarks.md, Design measurements.  Batched
# decode and speculative verify steps (2-16 rows) gain most.
# AVX2 without AVX-512 unpacks into the same quads (simd_x86_quads: `vpmaddubsw` + `vpmaddwd`); its
# int16 nibble kernels need a separate pass for fifth bits or crumbs, so there the quads win from one
# row for the fifth-bit kinds and Q6_K (docs/benchmarks.md, Design measurements).
# ... and with AVX-VNNI (256-bit `vpdpbusd`: AVX2_VNNI), one instruction per 8 rows x 4 elements sums them.
AVX2_QUADS = AVX2_ONLY
QUADS = HAVE_VNNI or AVX2_QUADS
QUAD_ROWS = 3
QUAD_ROWS_Q6 = 2
# The fifth-bit kinds: AVX2 has no fast direct kernel for them (high_bit_sums is a portable loop).
QUAD_ROWS_FIVE = 1 if AVX2_QUADS else QUAD_ROWS
# The SIMD kernel family this CPU runs (what `bench` reports).
_FAMILIES = ((HAVE_VNNI, "avx512-vnni"), (HAVE_AVX512, "avx512"))
_FAMILIES += ((AVX2_VNNI, "avx2-vnni"), (HAVE_AVX2, "avx2"))
KERNEL_FAMILY = next((name for have, name in _FAMILIES if have), "portable")
# Q6_K's int32 sums cover this many blocks at a time: (ROW_CHUNK, Q6_BLOCKS, 2, R) int32 = 512 KiB
# (AVX2: 64 KiB, which stays in a smaller L2 and ran the sums a quarter faster).
Q6_BLOCKS = 8 if AVX2_QUADS else 64


@njit(cache=True)
def first_direct_row(t: int) -> int:
    """The first of t activation rows that tile_nibbles may hand the direct kernel (which alone reads
    the fifth-bit tables): with quads, only a last chunk of fewer than QUAD_ROWS rows."""
    if not QUADS:
        return 0
    tail = t % ROW_CHUNK
    return t - tail if tail < QUAD_ROWS else t


@njit(cache=True)
def sums_len(q6: bool, rows: int, nb: int) -> int:
    """int32 entries of the per-chunk sums scratch tile_nibbles / tile_q6_k take."""
    if q6:
        return rows * min(nb, Q6_BLOCKS) * 2 * R
    return rows * nb * R if QUADS else 0


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
        if AVX2_VNNI and not wide:
            block = q8_block_sums_avxvnni
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


def quad_sums_rows(q3, qh3, x8, t0, t1, s32, quads) -> None:
    """s32[ti - t0, b, r] = sum over block b of q * x8[ti] for rows t0..t1-1 (plain-order x8), q the
    nibble plus 16 x fifth bit where qh3 has blocks: nibble_sums32_portable's sums, each weight
    block unpacked once for all the rows (AVX512-VNNI, or AVX2 without AVX-512; else the portable
    loop per row).
    quads: QUADS_BYTES uint8 scratch.  (Numba only.)"""
    raise NotImplementedError


@overload(quad_sums_rows, jit_options={"cache": True})
def _quad_sums_rows_impl(q3, qh3, x8, t0, t1, s32, quads):
    if HAVE_VNNI:

        def vnni(q3, qh3, x8, t0, t1, s32, quads):
            q, h, p, x, s = (
                q3.ctypes.data,
                qh3.ctypes.data,
                quads.ctypes.data,
                x8.ctypes.data,
                s32.ctypes.data,
            )
            k, row, five = x8.shape[1], s32.shape[1] * R * 4, qh3.shape[0] > 0
            for b in range(q3.shape[0]):
                if five:
                    q5_unpack_quads_vnni(q + b * 16 * R, h + b * 4 * R, p)
                else:
                    q4_unpack_quads_vnni(q + b * 16 * R, 0, p)
                for ti in range(t0, t1):
                    quad_sums_vnni(p, x + ti * k + b * 32, s + (ti - t0) * row + b * R * 4)

        return vnni
    if AVX2_QUADS:
        five_sums = quad_sums_avxvnni if AVX2_VNNI else q5_quad_sums_avx2
        four_sums = quad_sums_avxvnni if AVX2_VNNI else q4_quad_sums_avx2

        def avx2(q3, qh3, x8, t0, t1, s32, quads):
            q, h, p, x = q3.ctypes.data, qh3.ctypes.data, quads.ctypes.data, x8.ctypes.data
            k, row, s = x8.shape[1], s32.shape[1] * R * 4, s32.ctypes.data
            if qh3.shape[0] > 0:
                for b in range(q3.shape[0]):
                    q5_unpack_quads_avx2(q + b * 16 * R, h + b * 4 * R, p)
                    for ti in range(t0, t1):
                        five_sums(p, x + ti * k + b * 32, s + (ti - t0) * row + b * R * 4)
            else:
                for b in range(q3.shape[0]):
                    q4_unpack_quads_avx2(q + b * 16 * R, 0, p)
                    for ti in range(t0, t1):
                        four_sums(p, x + ti * k + b * 32, s + (ti - t0) * row + b * R * 4)

        return avx2

    def portable(q3, qh3, x8, t0, t1, s32, quads):
        for ti in range(t0, t1):
            nibble_sums32_portable(q3, qh3, x8[ti], s32[ti - t0])

    return portable


@njit(cache=True, fastmath=True, error_model="numpy")
def nibble_sums32_portable(q3, qh3, xr, s32) -> None:
    """s32[b, r] = sum_e q[b, e, r] * x[32b + e], q = nibble (+ 16 x fifth bit if qh3 has blocks),
    int32, plain-order x: the portable twin of quad_sums_rows."""
    five = qh3.shape[0] > 0
    for b in range(q3.shape[0]):
        xo = b * 32
        for r in range(R):
            s = i32(0)
            for j in range(16):
                q = i32(q3[b, j, r])
                lo, hi = q & 15, q >> 4
                if five:
                    lo += 16 * ((i32(qh3[b, 0, r]) >> j) & 1)
                    hi += 16 * ((i32(qh3[b, 1, r]) >> j) & 1)
                s += lo * i32(xr[xo + j]) + hi * i32(xr[xo + 16 + j])
            s32[b, r] = s


def q6_sums_rows(q3, qh2, x8, b0, t0, t1, s32, quads) -> None:
    """For Q6_K blocks b0..b0 + len(q3) - 1 and rows t0..t1-1: s32[ti - t0, b - b0] = the two halves'
    sums of (nibble + 16 x crumb) * x8[ti] (q6_sums32_portable's), each block unpacked once
    (AVX512-VNNI, or AVX2 without AVX-512; else the portable loop per row).  (Numba only.)"""
    raise NotImplementedError


@overload(q6_sums_rows, jit_options={"cache": True})
def _q6_sums_rows_impl(q3, qh2, x8, b0, t0, t1, s32, quads):
    if HAVE_VNNI:

        def vnni(q3, qh2, x8, b0, t0, t1, s32, quads):
            q, h, p, s = q3.ctypes.data, qh2.ctypes.data, quads.ctypes.data, s32.ctypes.data
            k, row = x8.shape[1], s32.shape[1] * 2 * R * 4
            x = x8.ctypes.data + b0 * 32
            for b in range(q3.shape[0]):
                q6_unpack_quads_vnni(q + b * 16 * R, h + b * 8 * R, p)
                for ti in range(t0, t1):
                    quad_sums_split_vnni(p, x + ti * k + b * 32, s + (ti - t0) * row + b * 2 * R * 4)

        return vnni
    if AVX2_QUADS:
        six_sums = quad_sums_split_avxvnni if AVX2_VNNI else q6_quad_sums_avx2

        def avx2(q3, qh2, x8, b0, t0, t1, s32, quads):
            q, h, p, s = q3.ctypes.data, qh2.ctypes.data, quads.ctypes.data, s32.ctypes.data
            k, row = x8.shape[1], s32.shape[1] * 2 * R * 4
            x = x8.ctypes.data + b0 * 32
            for b in range(q3.shape[0]):
                q6_unpack_quads_avx2(q + b * 16 * R, h + b * 8 * R, p)
                for ti in range(t0, t1):
                    six_sums(p, x + ti * k + b * 32, s + (ti - t0) * row + b * 2 * R * 4)

        return avx2

    def portable(q3, qh2, x8, b0, t0, t1, s32, quads):
        for ti in range(t0, t1):
            q6_sums32_portable(q3, qh2, x8[ti, 32 * b0 :], s32[ti - t0])

    return portable


@njit(cache=True, fastmath=True, error_model="numpy")
def q6_sums32_portable(q3, qh2, xr, s32) -> None:
    """Q6_K's unsigned 6-bit values (nibble + 16 x crumb) times plain-order x, per block and half:
    s32[b, 0, r] over elements 0..15, s32[b, 1, r] over 16..31 (int32): q6_sums_rows' twin."""
    for b in range(q3.shape[0]):
        xo = b * 32
        for r in range(R):
            lo = i32(0)
            hi = i32(0)
            for j in range(16):
                q = i32(q3[b, j, r])
                c_lo = (i32(qh2[b, j % 8, r]) >> (2 * (j // 8))) & 3  # element e: byte e % 8, bits 2(e // 8)
                c_hi = (i32(qh2[b, j % 8, r]) >> (2 * (2 + j // 8))) & 3
                lo += ((q & 15) + 16 * c_lo) * i32(xr[xo + j])
                hi += ((q >> 4) + 16 * c_hi) * i32(xr[xo + 16 + j])
            s32[b, 0, r] = lo
            s32[b, 1, r] = hi


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def tile_nibbles(q3, qh3, x8, x8p, bits, dx, sx, dsc, msc, kd, ksm, acc, s16, sums, pairs) -> None:
    """Q4_0/Q4_1/Q4_K and, with a non-empty qh3, Q5_0/Q5_1/Q5_K: w = dsc * q + msc per 32-block,
    q = nibble (+ 16 * fifth bit); dsc/msc (nb, R) from blockscales.
    sum_j w_j x_j = dsc * dx * sum_j(q_j x8_j) + msc * sx.  K kinds instead pass their fields, kd (ns,
    2, R) fp16 bits and ksm (nb, 2, R) (empty otherwise): superblock.k_step scales their sums.
    bits: x8's bit_tables (five-bit kinds).  s16 (4, ROW_CHUNK, nb, R) int16 and sums (sums_len)
    int32 scratch.  A few rows take the direct kernel, more rows an unpack-once one; all give the
    same integer sums, and the float step below is shared, so a row's result does not depend on
    how many rows came with it."""
    five = qh3.shape[0] > 0
    slo, shi, sh = s16[0], s16[1], s16[2, 0]
    nb = q3.shape[0]
    s32 = sums[: min(x8.shape[0], ROW_CHUNK) * nb * R].reshape((-1, nb, R))
    for t0 in range(0, x8.shape[0], ROW_CHUNK):
        t1 = min(x8.shape[0], t0 + ROW_CHUNK)
        direct = t1 - t0 < (QUAD_ROWS_FIVE if five else QUAD_ROWS) if QUADS else t1 - t0 <= DIRECT_ROWS
        if direct:
            for ti in range(t0, t1):
                nibble_sums(q3, x8p[ti], slo[ti - t0], shi[ti - t0])
        elif QUADS:
            quad_sums_rows(q3, qh3, x8, t0, t1, s32, pairs)
        else:
            nibble_sums_rows(q3, x8p, t0, t1, slo, shi, pairs)
        for ti in range(t0, t1):
            if five and (direct or not QUADS):
                high_bit_sums_tables(qh3, x8[ti], bits[ti], sh)
            if QUADS and direct:
                _combine_nibbles(slo[ti - t0], shi[ti - t0], sh, five, s32[ti - t0])
            if QUADS and kd.shape[0] > 0:
                _k_sums(s32[ti - t0], kd, ksm, dx[ti], sx[ti], acc[ti])
            elif QUADS:
                _scale_sums(s32[ti - t0], dx[ti], sx[ti], dsc, msc, acc[ti])
            elif kd.shape[0] > 0:
                _k_nibbles(slo[ti - t0], shi[ti - t0], sh, five, kd, ksm, dx[ti], sx[ti], acc[ti])
            else:
                _scale_nibbles(slo[ti - t0], shi[ti - t0], sh, five, dx[ti], sx[ti], dsc, msc, acc[ti])


@njit(cache=True, inline="always")
def _k_sums(s32, kd, ksm, dx, sx, acc) -> None:
    """K kinds' float step over int32 block sums s32 (nb, R), a superblock at a time."""
    for sb in range(kd.shape[0]):
        b0 = sb * BLOCKS
        k_step_sums(s32[b0].ctypes.data, 0, 0, 4 * R, ksm[b0].ctypes.data, kd[sb].ctypes.data,
                    dx[b0:].ctypes.data, sx[b0:].ctypes.data, acc.ctypes.data)  # fmt: skip


@njit(cache=True, inline="always")
def _k_nibbles(slo, shi, sh, five, kd, ksm, dx, sx, acc) -> None:
    """K kinds' float step over int16 half sums slo/shi (nb, R) and fifth-bit sums sh."""
    for sb in range(kd.shape[0]):
        b0 = sb * BLOCKS
        lo, hi, h, m = slo[b0].ctypes.data, shi[b0].ctypes.data, sh[b0].ctypes.data, ksm[b0].ctypes.data
        d, x, s, a = kd[sb].ctypes.data, dx[b0:].ctypes.data, sx[b0:].ctypes.data, acc.ctypes.data
        if five:
            k_step_five(lo, hi, h, 2 * R, m, d, x, s, a)
        else:
            k_step_pairs(lo, hi, h, 2 * R, m, d, x, s, a)


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _combine_nibbles(slo, shi, sh, five, s32) -> None:
    for b in range(slo.shape[0]):
        for r in range(R):
            s = i32(slo[b, r]) + i32(shi[b, r])
            if five:
                s += 16 * i32(sh[b, r])
            s32[b, r] = s


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _scale_sums(s32, dx, sx, dsc, msc, acc) -> None:
    for b in range(s32.shape[0]):
        dxb, sxb = dx[b], sx[b]
        for r in range(R):
            acc[r] = fma_f32(dsc[b, r] * dxb, f32(s32[b, r]), fma_f32(msc[b, r], sxb, acc[r]))


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _scale_nibbles(slo, shi, sh, five, dx, sx, dsc, msc, acc) -> None:
    for b in range(slo.shape[0]):
        dxb, sxb = dx[b], sx[b]
        for r in range(R):
            s = i32(slo[b, r]) + i32(shi[b, r])
            if five:
                s += 16 * i32(sh[b, r])
            acc[r] = fma_f32(dsc[b, r] * dxb, f32(s), fma_f32(msc[b, r], sxb, acc[r]))


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def tile_q8_0(d, q3, x8, dx, acc, s32) -> None:
    """w = d * q.  d (nb, R) fp16 bits, q3 (nb, 8, R, 4) int8 quads; x8 int8 or int16 rows."""
    for ti in range(x8.shape[0]):
        q8_sums(q3, x8[ti], s32)
        for b in range(q3.shape[0]):
            dxb = dx[ti, b]
            for r in range(R):
                acc[ti, r] = fma_f32(f16_to_f32(d[b, r]) * dxb, f32(s32[b, r]), acc[ti, r])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def tile_q6_k(d, sc, qh2, q3, x8, dx, hs, acc, s16, sums, quads) -> None:
    """w = d * sc16 * (q - 32), q = nibble + 16 * crumb, one int8 scale per 16 elements.
    d (ns, R) fp16 bits, sc (nb, 2, R) int8, qh2 (nb, 8, R), q3 (nb, 16, R).  Per Q6_BLOCKS blocks
    and chunk of rows: int32 sums of q * x per half block (one row at a time, or with quads one
    unpacking per block for many rows), then the float step, from one place in the code."""
    slo, shi, clo, chi = s16[0, 0], s16[1, 0], s16[2, 0], s16[3, 0]
    nb, T = q3.shape[0], x8.shape[0]
    s32 = sums[: min(T, ROW_CHUNK) * min(nb, Q6_BLOCKS) * 2 * R].reshape((-1, min(nb, Q6_BLOCKS), 2, R))
    for b0 in range(0, nb, Q6_BLOCKS):
        b1 = min(nb, b0 + Q6_BLOCKS)
        qs, qh = q3[b0:b1], qh2[b0:b1]
        for t0 in range(0, T, ROW_CHUNK):
            t1 = min(T, t0 + ROW_CHUNK)
            if QUADS and t1 - t0 >= QUAD_ROWS_Q6:
                q6_sums_rows(qs, qh, x8, b0, t0, t1, s32, quads)
            else:
                for ti in range(t0, t1):
                    nibble_sums_split(qs, x8[ti, 32 * b0 :], slo, shi)
                    crumb_sums(qh, x8[ti, 32 * b0 :], clo, chi)
                    _combine_q6(slo, shi, clo, chi, b1 - b0, s32[ti - t0])
            for ti in range(t0, t1):
                _scale_q6(d, sc, dx[ti], hs[ti], b0, b1, s32[ti - t0], acc[ti])


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _combine_q6(slo, shi, clo, chi, nb, s32) -> None:
    for b in range(nb):
        _combine_half(slo[b], clo[b], s32[b, 0])
        _combine_half(shi[b], chi[b], s32[b, 1])


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _combine_half(s, c, out) -> None:
    # one half per loop: with all five arrays in one loop LLVM gave up vectorising
    for r in range(R):
        out[r] = i32(s[r]) + i32(16) * i32(c[r])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _scale_q6(d, sc, dx, hs, b0, b1, s32, acc) -> None:
    # int32 throughout (every value fits): Numba's int64 arithmetic kept LLVM from vectorising the lanes
    for b in range(b0, b1):
        h0, h1 = i32(32 * hs[2 * b]), i32(32 * hs[2 * b + 1])
        dxb = dx[b]
        for r in range(R):
            lo = i32(s32[b - b0, 0, r] - h0)
            hi = i32(s32[b - b0, 1, r] - h1)
            s = f32(i32(i32(sc[b, 0, r]) * lo + i32(sc[b, 1, r]) * hi))
            acc[r] = fma_f32(f16_to_f32(d[b >> 3, r]) * dxb, s, acc[r])
