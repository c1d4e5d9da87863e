"""Dequantize rows of a packed weight to float32, for the float GEMM path and for embeddings.

Lane kinds: `deq_<kind>(fields..., t, r0, r1, out)` writes rows r0..r1-1 of tile t into out[0:r1-r0].
Row kinds (file layout): `deq_rows_<kind>(raw, n0, n1, out)` writes rows n0..n1-1.
Formulas follow ggml's reference dequantizers (the same products in the same order), so results
match kernels/reference.py up to fused multiply-adds (fastmath may contract d * q + m).
"""

from __future__ import annotations

from numba import njit

from ..quant.types import QUANT_BY_NAME
from .simd import bf16_to_f32, f16_to_f32, f32, i32

# Bytes per super-block, from quant's type table (Numba freezes these globals as constants).
_Q2_K_BYTES = QUANT_BY_NAME["Q2_K"].type_size
_Q3_K_BYTES = QUANT_BY_NAME["Q3_K"].type_size


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_nibbles(qs, qh, t, r0, r1, dsc, msc, out) -> None:
    """4-bit kinds, and 5-bit ones when qh is not empty: w = dsc * q + msc (see blockscales)."""
    five = qh.shape[1] > 0
    for r in range(r0, r1):
        for b in range(qs.shape[1]):
            d, m = dsc[b, r], msc[b, r]
            h0 = i32(qh[t, b, 0, r]) if five else 0
            h1 = i32(qh[t, b, 1, r]) if five else 0
            for j in range(16):
                q = i32(qs[t, b, j, r])
                out[r - r0, b * 32 + j] = d * f32((q & 15) | (((h0 >> j) & 1) << 4)) + m
                out[r - r0, b * 32 + 16 + j] = d * f32((q >> 4) | (((h1 >> j) & 1) << 4)) + m


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_q8_0(d, qs, t, r0, r1, out) -> None:
    """qs (nt, nb, 8, R, 4): element 4g + e of block b of row r is qs[t, b, g, r, e]."""
    for r in range(r0, r1):
        for b in range(qs.shape[1]):
            dd = f16_to_f32(d[t, b, r])
            for g in range(8):
                for e in range(4):
                    out[r - r0, b * 32 + 4 * g + e] = dd * f32(qs[t, b, g, r, e])


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_q6_k(d, sc, qh2, qs, t, r0, r1, out) -> None:
    for r in range(r0, r1):
        for b in range(qs.shape[1]):
            ds = f16_to_f32(d[t, b >> 3, r])
            d0, d1 = ds * f32(sc[t, b, 0, r]), ds * f32(sc[t, b, 1, r])
            for j in range(16):
                q = i32(qs[t, b, j, r])
                c = i32(qh2[t, b, j & 7, r]) >> (2 * (j >> 3))
                out[r - r0, b * 32 + j] = d0 * f32(((q & 15) | ((c & 3) << 4)) - 32)
                out[r - r0, b * 32 + 16 + j] = d1 * f32(((q >> 4) | (((c >> 4) & 3) << 4)) - 32)


# ---- row kinds: the file's own layout -----------------------------------------------------------


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_rows_f32(w, n0, n1, out) -> None:
    for n in range(n0, n1):
        out[n - n0, :] = w[n, :]


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_rows_f16(w, n0, n1, out) -> None:
    """w: fp16 bits as uint16 (N, K)."""
    for n in range(n0, n1):
        for k in range(w.shape[1]):
            out[n - n0, k] = f16_to_f32(w[n, k])


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_rows_bf16(w, n0, n1, out) -> None:
    for n in range(n0, n1):
        for k in range(w.shape[1]):
            out[n - n0, k] = bf16_to_f32(w[n, k])


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_rows_q2_k(raw, n0, n1, out) -> None:
    """Block (84 B): scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.  Element
    128h + 32j + 16p + l is crumb j of qs[32h + 16p + l], with scale/min index 8h + 2j + p."""
    for n in range(n0, n1):
        for sb in range(raw.shape[1] // _Q2_K_BYTES):
            o = sb * _Q2_K_BYTES
            d = f16_to_f32(i32(raw[n, o + 80]) | (i32(raw[n, o + 81]) << 8))
            dmin = f16_to_f32(i32(raw[n, o + 82]) | (i32(raw[n, o + 83]) << 8))
            for e16 in range(16):  # e16 = 8h + 2j + p
                h, j, p = e16 >> 3, (e16 >> 1) & 3, e16 & 1
                sc = i32(raw[n, o + e16])
                dl, ml = d * f32(sc & 15), dmin * f32(sc >> 4)
                for i in range(16):
                    q = (i32(raw[n, o + 16 + 32 * h + 16 * p + i]) >> (2 * j)) & 3
                    out[n - n0, sb * 256 + 16 * e16 + i] = dl * f32(q) - ml


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _q3_k_scale(raw, n, o, i):
    """Signed 6-bit scale i of a Q3_K block at byte offset o (scales start at o + 96)."""
    s = o + 96
    low = (i32(raw[n, s + i]) & 15) if i < 8 else (i32(raw[n, s + i - 8]) >> 4)
    high = (i32(raw[n, s + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return i32(low | (high << 4)) - 32


@njit(cache=True, fastmath=True, error_model="numpy")
def deq_rows_q3_k(raw, n0, n1, out) -> None:
    """Block (110 B): hmask[32], qs[64], scales[12], d.  Element 128h + 32j + 16p + l: crumb j of
    qs[32h + 16p + l], minus 4 unless bit 4h + j of hmask[16p + l] is set; scale 8h + 2j + p."""
    for n in range(n0, n1):
        for sb in range(raw.shape[1] // _Q3_K_BYTES):
            o = sb * _Q3_K_BYTES
            d = f16_to_f32(i32(raw[n, o + 108]) | (i32(raw[n, o + 109]) << 8))
            for e16 in range(16):
                h, j, p = e16 >> 3, (e16 >> 1) & 3, e16 & 1
                dl = d * f32(_q3_k_scale(raw, n, o, e16))
                for i in range(16):
                    q = i32((raw[n, o + 32 + 32 * h + 16 * p + i] >> (2 * j)) & 3)
                    hbit = (i32(raw[n, o + 16 * p + i]) >> (4 * h + j)) & 1
                    out[n - n0, sb * 256 + 16 * e16 + i] = dl * f32(q - (0 if hbit else 4))
