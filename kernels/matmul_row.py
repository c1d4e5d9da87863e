"""One activation row (decode) through a weight tile, block by block, with nothing staged in memory.

The general tile kernels (matmul_int) first compute a whole tile's float scales, then its integer sums
into (nb, R) arrays, then the float step: for one row that wrote and re-read ~1 byte of scratch per
weight byte, and the weight stream from memory paused during every pass that read no weights (one
core: 29 GB/s with the weights in cache, 17 from memory).  Here each 32-block's integer sums (the same
SIMD block kernels) go to 2 x R int16 in L1 and are scaled at once, so loads of the weights are spread
over the whole tile.  The float step is the same operations in the same order as matmul_int's
(`_scale_sums`, `_scale_q6`, with blockscales' scale products): a row's bits do not depend on which
path computed it, and tests compare the two.  With AVX2 or AVX-512 only; portable CPUs keep matmul_int.
"""

from __future__ import annotations

from numba import njit
from numba.extending import overload

from .packing import TILE_ROWS as R
from .simd import EXACT_FP, f16_to_f32, f32, fma_f32, i32
from .simd_x86 import HAVE_AVX2, crumb_sums_avx2, q4_block_sums_avx2, q4_block_sums_split_avx2
from .simd_x512 import HAVE_AVX512, crumb_sums_avx512, q4_block_sums_avx512, q4_block_sums_split_avx512

FUSED_ROW = HAVE_AVX2  # the block kernels below exist
# Up to this many activation rows take these kernels (decode of one sequence is 1 row; the output
# projection's precise pass 2).  More rows share the unpacking in matmul_int's kernels.
FUSED_MAX_ROWS = 2


def nibble_block(q, x, s0, s1) -> None:
    """One 32-block's interleaved nibble sums (matmul_int.nibble_sums for a single block), by address."""
    raise NotImplementedError


@overload(nibble_block, inline="always", jit_options={"cache": True})
def _nibble_block_impl(q, x, s0, s1):
    block = q4_block_sums_avx512 if HAVE_AVX512 else q4_block_sums_avx2
    return lambda q, x, s0, s1: block(q, x, s0, s1)


def q6_block(q, h, x, s) -> None:
    """One Q6_K 32-block's split nibble sums (s[0], s[1]) and crumb sums (s[2], s[3]), by address."""
    raise NotImplementedError


@overload(q6_block, inline="always", jit_options={"cache": True})
def _q6_block_impl(q, h, x, s):
    nib = q4_block_sums_split_avx512 if HAVE_AVX512 else q4_block_sums_split_avx2
    crumb = crumb_sums_avx512 if HAVE_AVX512 else crumb_sums_avx2

    def both(q, h, x, s):
        nib(q, x, s, s + 2 * R)
        crumb(h, x, s + 4 * R, s + 6 * R)

    return both


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _step(s2, dsc, msc, dxb, sxb, acc, r) -> None:
    """matmul_int._scale_sums for one lane: acc += dsc * dx * (lo + hi sums) + msc * sx."""
    acc[r] = fma_f32(dsc * dxb, f32(i32(i32(s2[0, r]) + i32(s2[1, r]))), fma_f32(msc, sxb, acc[r]))


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q4_0(d, q3, xr, dx, sx, acc, s2) -> None:
    """Q4_0 (blockscales.scales_d, offset 8): d (nb, R) fp16 bits of one tile, q3 (nb, 16, R),
    xr (T, k) rows of quantize_act's x8p, dx/sx (T, nb) their block scales and sums, acc (T, R),
    s2 (4, R) int16 scratch.  Each block is loaded once for the T (few) rows."""
    q, x, s, k = q3.ctypes.data, xr.ctypes.data, s2.ctypes.data, xr.shape[1]
    for b in range(q3.shape[0]):
        for ti in range(xr.shape[0]):
            nibble_block(q + b * 16 * R, x + ti * k + b * 32, s, s + 2 * R)
            dxb, sxb, a = dx[ti, b], sx[ti, b], acc[ti]
            for r in range(R):
                dd = f16_to_f32(d[b, r])
                _step(s2, dd, f32(-8.0) * dd, dxb, sxb, a, r)


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q4_1(dm, q3, xr, dx, sx, acc, s2) -> None:
    """Q4_1 (blockscales.scales_dm): dm (nb, 2, R) fp16 bits; otherwise as row_q4_0."""
    q, x, s, k = q3.ctypes.data, xr.ctypes.data, s2.ctypes.data, xr.shape[1]
    for b in range(q3.shape[0]):
        for ti in range(xr.shape[0]):
            nibble_block(q + b * 16 * R, x + ti * k + b * 32, s, s + 2 * R)
            dxb, sxb, a = dx[ti, b], sx[ti, b], acc[ti]
            for r in range(R):
                _step(s2, f16_to_f32(dm[b, 0, r]), f16_to_f32(dm[b, 1, r]), dxb, sxb, a, r)


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q4_k(dd, sm, q3, xr, dx, sx, acc, s2) -> None:
    """Q4_K (blockscales.scales_k): dd (ns, 2, R) fp16 bits, sm (nb, 2, R) 6-bit scales and mins."""
    q, x, s, k = q3.ctypes.data, xr.ctypes.data, s2.ctypes.data, xr.shape[1]
    for b in range(q3.shape[0]):
        for ti in range(xr.shape[0]):
            nibble_block(q + b * 16 * R, x + ti * k + b * 32, s, s + 2 * R)
            dxb, sxb, a = dx[ti, b], sx[ti, b], acc[ti]
            for r in range(R):
                dsc = f16_to_f32(dd[b >> 3, 0, r]) * f32(sm[b, 0, r])
                msc = -(f16_to_f32(dd[b >> 3, 1, r]) * f32(sm[b, 1, r]))
                _step(s2, dsc, msc, dxb, sxb, a, r)


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def row_q6_k(d, sc, qh2, q3, xr, dx, hs, acc, s4) -> None:
    """Q6_K (matmul_int.tile_q6_k for one row): d (ns, R) fp16 bits, sc (nb, 2, R) int8, qh2
    (nb, 8, R), q3 (nb, 16, R); xr (T, k) plain-order int8 x, hs their 16-element sums."""
    q, h, x, s, k = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, s4.ctypes.data, xr.shape[1]
    for b in range(q3.shape[0]):
        for ti in range(xr.shape[0]):
            q6_block(q + b * 16 * R, h + b * 8 * R, x + ti * k + b * 32, s)
            h0, h1 = i32(32 * hs[ti, 2 * b]), i32(32 * hs[ti, 2 * b + 1])
            dxb = dx[ti, b]
            for r in range(R):
                lo = i32(i32(s4[0, r]) + i32(16) * i32(s4[2, r]) - h0)
                hi = i32(i32(s4[1, r]) + i32(16) * i32(s4[3, r]) - h1)
                sv = f32(i32(i32(sc[b, 0, r]) * lo + i32(sc[b, 1, r]) * hi))
                acc[ti, r] = fma_f32(f16_to_f32(d[b >> 3, r]) * dxb, sv, acc[ti, r])
