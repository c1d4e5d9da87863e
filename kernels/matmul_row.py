"""One or two activation rows (decode) through a weight tile, block by block, nothing staged in memory.

The general tile kernels (matmul_int) first compute a whole tile's float scales, then its integer sums
into (nb, R) arrays, then the float step: for one row that wrote and re-read ~1 byte of scratch per
weight byte, and the weight stream from memory paused during every pass that read no weights (far
slower from memory than with the weights in cache).  Here each 32-block's integer sums (the same
SIMD block kernels) go to a few R-lane vectors in L1 and are scaled at once, so loads of the weights
are spread over the whole tile.  The float step is the same operations in the same order as
matmul_int's (`_scale_sums`, `_scale_q6`, `tile_q8_0`, with blockscales' scale products): a row's bits
do not depend on which path computed it, and tests compare the two.  With AVX2 or AVX-512 only (the
fifth-bit kinds with AVX-512); other CPUs keep matmul_int.
"""

from __future__ import annotations

from numba import carray, errors, njit, types
from numba.extending import overload

from .packing import MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .packing import TILE_ROWS as R
from .simd import EXACT_FP, f16_to_f32, f32, fma_f32, i32, prefetch, ptr_i16, ptr_i32
from .simd_x86 import (
    HAVE_AVX2,
    crumb_sums_avx2,
    q4_block_sums_avx2,
    q4_block_sums_split_avx2,
    q5_high_sums_avx2,
    q8_block_sums16_avx2,
    q8_block_sums_avx2,
    q8_block_sums_avxvnni,
)
from .simd_x86_quads import q6_quad_sums_avx2, q6_unpack_quads_avx2, quad_sums_split_avxvnni
from .simd_x512 import (
    AVX2_ONLY,
    AVX2_VNNI,
    BIT_TABLES,
    HAVE_AVX512,
    HAVE_VNNI,
    crumb_sums_avx512,
    q4_block_sums_avx512,
    q4_block_sums_split_avx512,
    q4_block_sums_vnni,
    q5_high_sums_avx512,
    q6_block_sums2_vnni,
    q6_block_sums_vnni,
    q6_unpack_quads_vnni,
    q8_block_sums16_avx512,
    q8_block_sums16_vnni,
    q8_block_sums_vnni,
    quad_sums_split_vnni,
)
from .superblock import BLOCKS, k_step_five, k_step_pairs, k_step_sums

# Up to this many activation rows take these kernels (decode of one sequence is 1 row, the output
# projection's precise pass 2, a few sequences or a speculative verify step more); more rows share the
# unpacking in matmul_int.  Each limit is where the fused kernels stopped beating matmul_int's (one
# core, weights from memory: docs/benchmarks.md, Kernels).  Q8_0 has no shared unpacking and Q6_K's
# fused form unpacks once too: both stay fused up to 16 rows.
FUSED_MAX_ROWS = 8
FUSED_MAX_ROWS_Q6_Q8 = 16
# The fifth-bit kinds' unpack-once kernel shares the fifth bits' work too: fused only up to 4 rows there.
FUSED_MAX_ROWS_Q5 = 4
# Q6_K from this many rows unpacks each block once into quads: with VNNI as fast as the fused form at
# 2 rows, faster from 3; with AVX2 only (simd_x86_quads) faster from one row, whose split and crumb
# passes cost more than the unpacking (docs/benchmarks.md, Design measurements)
Q6_QUADS = HAVE_VNNI or AVX2_ONLY
Q6_QUAD_ROWS = 3 if HAVE_VNNI else 1
# With VNNI, one or two rows assemble the six-bit values in registers instead (row_q6_k_vnni): a 64-row
# block in cache takes half the time of the split and crumb sums, and from memory it streams ~1.6x
# as fast (docs/benchmarks.md, AVX-512 on AMD Zen 4).
Q6_VNNI_ROWS = 2 if HAVE_VNNI else 0
FIVE_BIT = (Q5_0, Q5_1, Q5_K)
# The 4/5-bit kinds with a kernel here on this CPU, and up to how many rows each takes it.
NIBBLE_ROWS = dict.fromkeys((Q4_0, Q4_1, Q4_K) if HAVE_AVX2 else (), FUSED_MAX_ROWS)
NIBBLE_ROWS.update(dict.fromkeys(FIVE_BIT if HAVE_AVX2 else (), FUSED_MAX_ROWS_Q5))
FUSED_Q6_Q8 = HAVE_AVX2
_NIBBLE_BLOCK = q4_block_sums_avx512 if HAVE_AVX512 else q4_block_sums_avx2
Q4_K_INT32_SUMS = HAVE_VNNI  # one row's Q4_K blocks summed straight into int32 (_row_q4_k_vnni)
_SPLIT_BLOCK = q4_block_sums_split_avx512 if HAVE_AVX512 else q4_block_sums_split_avx2
_CRUMB_BLOCK = crumb_sums_avx512 if HAVE_AVX512 else crumb_sums_avx2
_Q6_UNPACK = q6_unpack_quads_vnni if HAVE_VNNI else q6_unpack_quads_avx2
_Q6_SUMS = quad_sums_split_vnni if HAVE_VNNI else q6_quad_sums_avx2
_Q8_BLOCK = q8_block_sums_vnni if HAVE_VNNI else q8_block_sums_avx2
_Q8_BLOCK16 = q8_block_sums16_vnni if HAVE_VNNI else q8_block_sums16_avx512
if not HAVE_AVX512:
    _Q8_BLOCK16 = q8_block_sums16_avx2
if AVX2_VNNI:  # AVX-VNNI: the 256-bit vpdpbusd forms
    _Q6_SUMS, _Q8_BLOCK = quad_sums_split_avxvnni, q8_block_sums_avxvnni


@njit(cache=True, inline="always")
def _scales_d8(f0, sm, b, r):
    dd = f16_to_f32(f0[b, 0, r])  # blockscales.scales_d, offset 8
    return dd, f32(-8.0) * dd


@njit(cache=True, inline="always")
def _scales_d16(f0, sm, b, r):
    dd = f16_to_f32(f0[b, 0, r])  # offset 16
    return dd, f32(-16.0) * dd


@njit(cache=True, inline="always")
def _scales_dm(f0, sm, b, r):
    return f16_to_f32(f0[b, 0, r]), f16_to_f32(f0[b, 1, r])  # blockscales.scales_dm


_SCALES = {Q4_0: _scales_d8, Q5_0: _scales_d16, Q4_1: _scales_dm, Q5_1: _scales_dm}
_SLOT = 4 * R * 2  # bytes of one block's (4, R) int16 sums
SUPER_BYTES = BLOCKS * _SLOT  # row_nibbles' scratch: a superblock's sums (K kinds)


def row_nibbles(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, scratch) -> None:
    """acc (T, R) += tile (q3 (nb, 16, R) nibbles, qh (nb, 2, R) fifth bits or empty) times rows xr
    (T, k) of quantize_act's x8p (x8: the same rows in plain order), T <= FUSED_MAX_ROWS.  f0: fp16
    scale bits as (blocks, 1 or 2, R) ((supers, 2, R) for K kinds), sm: K kinds' 6-bit scales (nb, 2,
    R); bits: the rows' fifth-bit tables; dx/sx (T, nb); scratch: SUPER_BYTES (64-byte aligned).
    kind: a compile-time constant.  (Numba only.)"""
    raise NotImplementedError


@overload(row_nibbles, jit_options={"cache": True, "fastmath": EXACT_FP, "error_model": "numpy"})
def _row_nibbles_impl(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, scratch):
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("row_nibbles: the weight kind must be a compile-time constant")
    kv = kind.literal_value
    if kv in (Q4_K, Q5_K):
        return _row_k_impl(kv == Q5_K)
    scales, five = _SCALES[kv], kv in FIVE_BIT

    def impl(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, scratch):
        s4 = _s4(scratch)
        s = scratch.ctypes.data
        for b in range(q3.shape[0]):
            for ti in range(xr.shape[0]):
                _nibble_block(q3, qh, xr, bits, b, ti, s, five)
                dxb, sxb, a = dx[ti, b], sx[ti, b], acc[ti]
                for r in range(R):  # matmul_int._combine_nibbles + _scale_sums
                    dsc, msc = scales(f0, sm, b, r)
                    si = i32(s4[0, r]) + i32(s4[1, r])
                    if five:
                        si += i32(16) * i32(s4[2, r])
                    a[r] = fma_f32(dsc * dxb, f32(i32(si)), fma_f32(msc, sxb, a[r]))

    return impl


@njit(cache=True, inline="always")
def _nibble_block(q3, qh, xr, bits, b, ti, s, five) -> None:
    """Block b's int16 sums for row ti into the (4, R) slot at address s: s0, s1 (and s2, fifth bits)."""
    k, tables = xr.shape[1], bits.shape[1] * 2  # bytes of one row's tables
    x, h = xr.ctypes.data + ti * k + b * 32, qh.ctypes.data + b * 4 * R
    _NIBBLE_BLOCK(q3.ctypes.data + b * 16 * R, x, s, s + 2 * R)
    if five and HAVE_AVX512:
        q5_high_sums_avx512(h, bits.ctypes.data + ti * tables + b * BIT_TABLES * 64, s + 4 * R, 0)
    elif five:
        q5_high_sums_avx2(h, x, s + 4 * R, 0)


@njit(cache=True, inline="always")
def _prefetch_scales(sm, f0) -> None:
    """The next superblock's scales (BLOCKS x 2R bytes at sm) and (d, dmin) (4R bytes at f0), while this
    one's integer sums run: its float step reads them all at once, and a miss there stalled the stream."""
    for o in range(0, BLOCKS * 2 * R, 64):
        prefetch(sm + o)
    for o in range(0, 4 * R, 64):
        prefetch(f0 + o)


def _row_q4_k_vnni(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, scratch):
    """_row_k_impl's Q4_K with AVX512-VNNI: each block's int32 sums (simd_x512.q4_block_sums_vnni,
    from the plain-order rows x8) into scratch, then superblock.k_step_sums."""
    q, x, s, k = q3.ctypes.data, x8.ctypes.data, scratch.ctypes.data, x8.shape[1]
    for sb in range(q3.shape[0] // BLOCKS):
        b0 = sb * BLOCKS
        if b0 + BLOCKS < q3.shape[0]:
            _prefetch_scales(sm[b0 + BLOCKS].ctypes.data, f0[sb + 1].ctypes.data)
        m, d = sm[b0].ctypes.data, f0[sb].ctypes.data
        for ti in range(x8.shape[0]):
            for j in range(BLOCKS):
                q4_block_sums_vnni(q + (b0 + j) * 16 * R, x + ti * k + (b0 + j) * 32, s + j * _SLOT, 0)
            xs, ss, a = dx[ti, b0:].ctypes.data, sx[ti, b0:].ctypes.data, acc[ti].ctypes.data
            k_step_sums(s, 0, 0, _SLOT, m, d, xs, ss, a)


def _row_k_impl(five: bool):
    """Q4_K / Q5_K: a superblock's eight blocks of sums into scratch, then superblock's float step
    (the same one matmul_int's tile path runs).  Q4_K with VNNI sums straight into int32."""
    if not five and Q4_K_INT32_SUMS:
        return _row_q4_k_vnni
    step = k_step_five if five else k_step_pairs

    def impl(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, scratch):
        s = scratch.ctypes.data
        for sb in range(q3.shape[0] // BLOCKS):
            b0 = sb * BLOCKS
            if b0 + BLOCKS < q3.shape[0]:
                _prefetch_scales(sm[b0 + BLOCKS].ctypes.data, f0[sb + 1].ctypes.data)
            for ti in range(xr.shape[0]):
                for j in range(BLOCKS):
                    _nibble_block(q3, qh, xr, bits, b0 + j, ti, s + j * _SLOT, five)
                step(s, s + 2 * R, s + 4 * R, _SLOT, sm[b0].ctypes.data, f0[sb].ctypes.data,
                     dx[ti, b0:].ctypes.data, sx[ti, b0:].ctypes.data, acc[ti].ctypes.data)  # fmt: skip

    return impl


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _q6_step(d, sc, b, r, dxb, lo, hi, acc):
    """matmul_int._scale_q6 for one lane: acc + d * dx * (sc_lo * lo + sc_hi * hi), lo/hi the two half
    blocks' int32 sums less 32 x their activation sums."""
    sv = f32(i32(i32(sc[b, 0, r]) * lo + i32(sc[b, 1, r]) * hi))
    return fma_f32(f16_to_f32(d[b >> 3, r]) * dxb, sv, acc)


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q6_k(d, sc, qh2, q3, xr, dx, hs, acc, s4) -> None:
    """Q6_K (matmul_int.tile_q6_k for T <= FUSED_MAX_ROWS_Q6_Q8 rows): d (ns, R) fp16 bits, sc (nb, 2, R)
    int8, qh2 (nb, 8, R), q3 (nb, 16, R); xr (T, k) plain-order int8 x, hs their 16-element sums."""
    q, h, x, s, k = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, s4.ctypes.data, xr.shape[1]
    for b in range(q3.shape[0]):
        for ti in range(xr.shape[0]):
            _SPLIT_BLOCK(q + b * 16 * R, x + ti * k + b * 32, s, s + 2 * R)
            _CRUMB_BLOCK(h + b * 8 * R, x + ti * k + b * 32, s + 4 * R, s + 6 * R)
            h0, h1 = i32(32 * hs[ti, 2 * b]), i32(32 * hs[ti, 2 * b + 1])
            dxb = dx[ti, b]
            for r in range(R):
                lo = i32(i32(s4[0, r]) + i32(16) * i32(s4[2, r]) - h0)
                hi = i32(i32(s4[1, r]) + i32(16) * i32(s4[3, r]) - h1)
                acc[ti, r] = _q6_step(d, sc, b, r, dxb, lo, hi, acc[ti, r])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q6_k_quads(d, sc, qh2, q3, xr, dx, hs, acc, s32, quads) -> None:
    """row_q6_k for Q6_QUAD_ROWS+ rows (AVX512-VNNI, or AVX2 only): each block unpacked once into
    quads (QUADS_BYTES of scratch) for all the rows, whose sums (2, R) int32 equal row_q6_k's lo and hi."""
    q, h, x, s, k = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, s32.ctypes.data, xr.shape[1]
    p = quads.ctypes.data
    for b in range(q3.shape[0]):
        _Q6_UNPACK(q + b * 16 * R, h + b * 8 * R, p)
        for ti in range(xr.shape[0]):
            _Q6_SUMS(p, x + ti * k + b * 32, s)
            h0, h1 = i32(32 * hs[ti, 2 * b]), i32(32 * hs[ti, 2 * b + 1])
            dxb = dx[ti, b]
            for r in range(R):
                lo, hi = i32(s32[0, r] - h0), i32(s32[1, r] - h1)
                acc[ti, r] = _q6_step(d, sc, b, r, dxb, lo, hi, acc[ti, r])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q6_k_vnni(d, sc, qh2, q3, xr, dx, hs, acc, pairs) -> None:
    """row_q6_k for up to Q6_VNNI_ROWS rows with AVX512-VNNI: each block's int32 half sums straight from
    simd_x512.q6_block_sums(2)_vnni (two rows share the assembled values); pairs: (4, R) int32 scratch."""
    q, h, x, k = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, xr.shape[1]
    s, T = pairs.ctypes.data, xr.shape[0]
    s32 = carray(ptr_i32(s), (4, R))
    for b in range(q3.shape[0]):
        qb, hb, xb = q + b * 16 * R, h + b * 8 * R, x + b * 32
        if T == 2:
            q6_block_sums2_vnni(qb, hb, xb, xb + k, s)
        else:
            q6_block_sums_vnni(qb, hb, xb, s)
        for ti in range(T):
            h0, h1 = i32(32 * hs[ti, 2 * b]), i32(32 * hs[ti, 2 * b + 1])
            dxb = dx[ti, b]
            for r in range(R):
                lo, hi = i32(s32[2 * ti, r] - h0), i32(s32[2 * ti + 1, r] - h1)
                acc[ti, r] = _q6_step(d, sc, b, r, dxb, lo, hi, acc[ti, r])


def row_q8_0(d, q4, xr, dx, acc, s32) -> None:
    """matmul_int.tile_q8_0 for T <= FUSED_MAX_ROWS_Q6_Q8 rows: d (nb, R) fp16 bits, q4 (nb, 8, R, 4) int8,
    xr (T, k) int8 or int16 activations, s32 (R,) int32 scratch.  (Numba only.)"""
    raise NotImplementedError


@overload(row_q8_0, jit_options={"cache": True, "fastmath": EXACT_FP, "error_model": "numpy"})
def _row_q8_0_impl(d, q4, xr, dx, acc, s32):
    wide = xr.dtype == types.int16
    block, x_bytes = (_Q8_BLOCK16, 64) if wide else (_Q8_BLOCK, 32)

    def impl(d, q4, xr, dx, acc, s32):
        q, x, s, k = q4.ctypes.data, xr.ctypes.data, s32.ctypes.data, xr.shape[1]
        for b in range(q4.shape[0]):
            for ti in range(xr.shape[0]):
                block(q + b * 32 * R, x + ti * k * (x_bytes // 32) + b * x_bytes, s, 0)
                dxb = dx[ti, b]
                for r in range(R):
                    acc[ti, r] = fma_f32(f16_to_f32(d[b, r]) * dxb, f32(s32[r]), acc[ti, r])

    return impl


@njit(cache=True, inline="always")
def _s4(pairs):
    """The (4, R) int16 block-sum scratch at the start of pairs (a pointer cast: a view + reshape
    per tile went through Numba's reshape helper, a call per tile)."""
    return carray(ptr_i16(pairs.ctypes.data), (4, R))


# ---- entry points for matmul.int_tile: run the fused kernel and return True where this CPU has one and
# the call's rows are within its limit, else return False (the caller runs matmul_int's kernel).  Chosen
# while typing, so a CPU without the instructions never compiles them.


def fused_limit(kind) -> int:
    """Up to how many rows int_tile takes this module's kernel for `kind` (a compile-time constant) on
    this CPU; 0: never.  (Numba only.)"""
    raise NotImplementedError


@overload(fused_limit, jit_options={"cache": True})
def _fused_limit_impl(kind):
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("fused_limit: the weight kind must be a compile-time constant")
    kv = kind.literal_value
    if kv == MXFP4:  # matmul_mxfp4 takes every row count itself: no general-kernel scratch
        return lambda kind: 1 << 30
    limit = FUSED_MAX_ROWS_Q6_Q8 if FUSED_Q6_Q8 else 0
    if kv not in (Q6_K, Q8_0):
        limit = NIBBLE_ROWS.get(kv, 0)
    return lambda kind: limit


def fused_q8_0(d, q4, xr, dx, acc, s32) -> bool:
    """row_q8_0 where it applies.  (Numba only.)"""
    raise NotImplementedError


@overload(fused_q8_0, jit_options={"cache": True}, inline="always")
def _fused_q8_0_impl(d, q4, xr, dx, acc, s32):
    if not FUSED_Q6_Q8:
        return lambda d, q4, xr, dx, acc, s32: False

    def impl(d, q4, xr, dx, acc, s32):
        if xr.shape[0] > FUSED_MAX_ROWS_Q6_Q8:
            return False
        row_q8_0(d, q4, xr, dx, acc, s32)
        return True

    return impl


def fused_q6_k(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs) -> bool:
    """row_q6_k (AVX-512 without VNNI, or one row with it) or row_q6_k_quads where they apply; s32
    (2, R) int32 and pairs (QUADS_BYTES uint8) scratch.  (Numba only.)"""
    raise NotImplementedError


@overload(fused_q6_k, jit_options={"cache": True}, inline="always")
def _fused_q6_k_impl(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs):
    if not FUSED_Q6_Q8:
        return lambda d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs: False
    quads = Q6_QUADS

    def rows(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs):
        T = xr.shape[0]
        if T > FUSED_MAX_ROWS_Q6_Q8:
            return False
        if quads and T >= Q6_QUAD_ROWS:
            row_q6_k_quads(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs)
        else:
            row_q6_k(d, sc, qh2, q3, xr, dx, hs, acc, _s4(pairs))
        return True

    if not Q6_VNNI_ROWS:  # typed only where the CPU has VNNI
        return rows
    others = njit(inline="always")(rows)

    def impl(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs):
        if xr.shape[0] > Q6_VNNI_ROWS:
            return others(d, sc, qh2, q3, xr, dx, hs, acc, s32, pairs)
        row_q6_k_vnni(d, sc, qh2, q3, xr, dx, hs, acc, pairs)
        return True

    return impl


def fused_nibbles(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, pairs) -> bool:
    """row_nibbles where this CPU has it for `kind` (a compile-time constant) and the rows are within
    NIBBLE_ROWS.  (Numba only.)"""
    raise NotImplementedError


@overload(fused_nibbles, jit_options={"cache": True}, inline="always")
def _fused_nibbles_impl(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, pairs):
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("fused_nibbles: the weight kind must be a compile-time constant")
    limit = NIBBLE_ROWS.get(kind.literal_value, 0)
    if limit == 0:
        return lambda kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, pairs: False

    def impl(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, pairs):
        if xr.shape[0] > limit:
            return False
        row_nibbles(kind, f0, sm, qh, q3, x8, xr, bits, dx, sx, acc, pairs)
        return True

    return impl
