"""MXFP4 weight tiles times int8-quantized activations, and their dequantizer.

A tile is (e (nb, R) E8M0 exponents, q3 (nb, 16, R) E2M1 codes; see packing.py).  Per 32-block and
activation row, the integer sum of the doubled E2M1 values times the int8 activations (exact in int32)
is scaled once: acc[r] += (2**(e - 128) * dx) * sum, the value ggml's MXFP4 x Q8_0 dot product forms.
With AVX2 the sums come from simd_mxfp4's IR kernels, straight from the packed codes for one row
(decode) or from value pairs looked up once per block for more rows (with AVX512-VNNI: quads, built in
registers for one row, unpacked once per block for more); elsewhere from plain loops that give the same
integers, so a row's bits never depend on the path.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit
from numba.extending import overload

from ..quant.ggml import MXFP4_VALUES
from .packing import TILE_ROWS as R
from .simd import EXACT_FP, f32, fma_f32, i32, i32_as_f32, ptr_i32
from .simd_mxfp4 import (
    VNNI_OFFSET,
    mxfp4_block_sums_avx2,
    mxfp4_block_sums_vnni,
    mxfp4_pair_sums_avx2,
    mxfp4_unpack_pairs_avx2,
    mxfp4_unpack_quads_vnni,
)
from .simd_x86 import HAVE_AVX2, PAIRS_BYTES
from .simd_x512 import HAVE_VNNI, QUADS_BYTES, quad_sums_vnni

# Up to this many activation rows per tile, each row's sums come straight from the packed codes; more
# rows look each block's values up once (the lookup and shuffles then cost once, not once per row).
# With VNNI two rows cost the same either way and three or more less through the quads
# (docs/benchmarks.md, "MXFP4 with VNNI").
DIRECT_ROWS = 1
assert QUADS_BYTES == PAIRS_BYTES  # the VNNI rows' quads use the AVX2 pairs' scratch
_VALUES = MXFP4_VALUES.astype(np.int32)  # Numba freezes it as a constant


@njit(cache=True, inline="always")
def e8m0_half(e):
    """An E8M0 byte -> float32 2**(e - 128), from its bits as ggml_e8m0_to_fp32_half (e < 2: subnormal,
    0x00200000 << e written as (e + 1) << 21). Shifts by constants, each result cut to 32 bits: the
    tiles' loops vectorise on 32-bit lanes (Numba widens int32 arithmetic to 64 bits)."""
    v = i32(e)
    return i32_as_f32(i32((v + 1) << 21) if v < 2 else i32((v - 1) << 23))


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _scale(e, b, dxb, s16, a) -> None:
    """a[r] += (2**(e[b, r] - 128) * dxb) * (s16[0, r] + s16[1, r]) for the tile's R lanes."""
    for r in range(R):
        a[r] = fma_f32(e8m0_half(e[b, r]) * dxb, f32(i32(i32(s16[0, r]) + i32(s16[1, r]))), a[r])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy", inline="always")
def _scale_total(e, b, dxb, off, s32, a) -> None:
    """_scale from one int32 total per row (mxfp4_block_sums_vnni's, less off): the same integer, so
    the same bits."""
    o = i32(off)
    for r in range(R):
        a[r] = fma_f32(e8m0_half(e[b, r]) * dxb, f32(i32(s32[r] - o)), a[r])


@njit(cache=True, fastmath=True, error_model="numpy")
def block_sums_portable(q3, b, xr, s16) -> None:
    """mxfp4_block_sums_avx2 in plain Numba: s16[0] over bytes j < 8, s16[1] over 8 <= j < 16, of
    v(lo) * x[j] + v(hi) * x[16 + j]; xr one row of interleaved int8 (quantize_act's x8p)."""
    xo = b * 32
    for r in range(R):
        s0 = i32(0)
        s1 = i32(0)
        for j in range(16):
            q = i32(q3[b, j, r])
            p = _VALUES[q & 15] * i32(xr[xo + 2 * j]) + _VALUES[q >> 4] * i32(xr[xo + 2 * j + 1])
            if j < 8:
                s0 += p
            else:
                s1 += p
        s16[0, r] = np.int16(s0)
        s16[1, r] = np.int16(s1)


def tile_mxfp4(e, q3, x8, x8p, dx, hs, acc, s16, pairs) -> None:
    """acc (T, R) += the tile (e (nb, R) uint8, q3 (nb, 16, R) uint8) times the rows x8p (T, k)
    (interleaved int8; x8 the same rows in plain order, hs their 16-element sums) scaled by dx (T, nb).
    s16: (2, R) int16 scratch (64-byte aligned, room for (R,) int32), pairs: simd_x86.PAIRS_BYTES
    uint8 scratch.  (Numba only: AVX2 or VNNI IR kernels where the CPU has them, else plain loops.)"""
    raise NotImplementedError


@overload(tile_mxfp4, jit_options={"cache": True, "fastmath": EXACT_FP, "error_model": "numpy"})
def _tile_mxfp4_impl(e, q3, x8, x8p, dx, hs, acc, s16, pairs):
    if not HAVE_AVX2:

        def portable(e, q3, x8, x8p, dx, hs, acc, s16, pairs):
            for b in range(q3.shape[0]):
                for ti in range(x8p.shape[0]):
                    block_sums_portable(q3, b, x8p[ti], s16)
                    _scale(e, b, dx[ti, b], s16, acc[ti])

        return portable

    if HAVE_VNNI:

        def vnni(e, q3, x8, x8p, dx, hs, acc, s16, pairs):
            if x8.shape[0] <= DIRECT_ROWS:
                _row_vnni(e, q3, x8, dx, hs, acc, s16)
            else:
                _rows_vnni(e, q3, x8, dx, hs, acc, s16, pairs)

        return vnni

    def simd(e, q3, x8, x8p, dx, hs, acc, s16, pairs):
        _rows_avx2(e, q3, x8p, dx, acc, s16, pairs)

    return simd


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def _row_vnni(e, q3, x8, dx, hs, acc, s16) -> None:
    """Rows x8 (T, k) plain int8 each through mxfp4_block_sums_vnni, the offset taken off per block."""
    q, x, s = q3.ctypes.data, x8.ctypes.data, s16.ctypes.data
    s32 = carray(ptr_i32(s), (R,))
    T, k = x8.shape
    for b in range(q3.shape[0]):
        for ti in range(T):
            mxfp4_block_sums_vnni(q + b * 16 * R, x + ti * k + b * 32, s, 0)
            off = VNNI_OFFSET * (hs[ti, 2 * b] + hs[ti, 2 * b + 1])
            _scale_total(e, b, dx[ti, b], off, s32, acc[ti])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def _rows_vnni(e, q3, x8, dx, hs, acc, s16, quads) -> None:
    """Rows x8 (T, k) through one mxfp4_unpack_quads_vnni per block (into quads, the pairs scratch:
    QUADS_BYTES == PAIRS_BYTES) and a quad_sums_vnni per row."""
    q, x, s, p = q3.ctypes.data, x8.ctypes.data, s16.ctypes.data, quads.ctypes.data
    s32 = carray(ptr_i32(s), (R,))
    T, k = x8.shape
    for b in range(q3.shape[0]):
        mxfp4_unpack_quads_vnni(q + b * 16 * R, p)
        for ti in range(T):
            quad_sums_vnni(p, x + ti * k + b * 32, s)
            off = VNNI_OFFSET * (hs[ti, 2 * b] + hs[ti, 2 * b + 1])
            _scale_total(e, b, dx[ti, b], off, s32, acc[ti])


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def _rows_avx2(e, q3, x8p, dx, acc, s16, pairs) -> None:
    """Rows x8p (T, k) through the AVX2 kernels: one straight from the codes, more from looked-up pairs."""
    q, x, s, p = q3.ctypes.data, x8p.ctypes.data, s16.ctypes.data, pairs.ctypes.data
    T, k = x8p.shape
    for b in range(q3.shape[0]):
        if T > DIRECT_ROWS:
            mxfp4_unpack_pairs_avx2(q + b * 16 * R, p)
        for ti in range(T):
            if T > DIRECT_ROWS:
                mxfp4_pair_sums_avx2(p, x + ti * k + b * 32, s, s + 2 * R)
            else:
                mxfp4_block_sums_avx2(q + b * 16 * R, x + ti * k + b * 32, s, s + 2 * R)
            _scale(e, b, dx[ti, b], s16, acc[ti])


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_mxfp4(e, qs, t, r0, r1, out) -> None:
    """Rows r0..r1-1 of tile t (e (nt, nb, R), qs (nt, nb, 16, R)) as float32 into out[0 : r1 - r0]."""
    for r in range(r0, r1):
        for b in range(qs.shape[1]):
            d = e8m0_half(e[t, b, r])
            for j in range(16):
                q = i32(qs[t, b, j, r])
                out[r - r0, b * 32 + j] = d * f32(_VALUES[q & 15])
                out[r - r0, b * 32 + 16 + j] = d * f32(_VALUES[q >> 4])
