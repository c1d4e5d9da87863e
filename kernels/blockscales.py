"""Per-32-block float scales of the 4/5-bit kinds, for a whole tile: w = dsc[b, r] * q + msc[b, r].

Computing them once per tile (instead of inside the integer loop) lets one integer kernel and one
dequantizer serve six formats.  dsc/msc are (nb, TILE_ROWS) float32.
"""

from __future__ import annotations

from numba import njit

from .packing import TILE_ROWS as R
from .simd import f16_to_f32, f32


@njit(cache=True, fastmath=True, error_model="numpy")
def scales_d(d, t, offset, dsc, msc) -> None:
    """Q4_0 (offset 8) / Q5_0 (offset 16): w = d * (q - offset)."""
    for b in range(d.shape[1]):
        for r in range(R):
            dd = f16_to_f32(d[t, b, r])
            dsc[b, r] = dd
            msc[b, r] = -offset * dd


@njit(cache=True, fastmath=True, error_model="numpy")
def scales_dm(dm, t, dsc, msc) -> None:
    """Q4_1 / Q5_1: w = d * q + m."""
    for b in range(dm.shape[1]):
        for r in range(R):
            dsc[b, r] = f16_to_f32(dm[t, b, 0, r])
            msc[b, r] = f16_to_f32(dm[t, b, 1, r])


@njit(cache=True, fastmath=True, error_model="numpy")
def scales_k(dd, sm, t, dsc, msc) -> None:
    """Q4_K / Q5_K: w = (d * sc) * q - dmin * mn, (d, dmin) per 256, 6-bit (sc, mn) per 32."""
    for b in range(sm.shape[1]):
        for r in range(R):
            dsc[b, r] = f16_to_f32(dd[t, b >> 3, 0, r]) * f32(sm[t, b, 0, r])
            msc[b, r] = -(f16_to_f32(dd[t, b >> 3, 1, r]) * f32(sm[t, b, 1, r]))
