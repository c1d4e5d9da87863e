"""Activation quantization to 8 bits per 32-element block, like ggml's Q8_0/Q8_1 for activations.

The integer matmul kernels multiply the weights' small integers with these int8 activations and
accumulate in int16/int32; float scales are applied once per block.  Per block of 32 we keep:
  x8  the int8 values, round(x / d) with d = max|x| / 127 (so |x8| <= 127: no int16 overflow later)
  dx  d
  sx  d * sum(x8)          (for the weights' per-block minimum/offset terms)
  hs  sum(x8) of each 16-element half, int32 (Q6_K has one scale per 16 elements)
  x8p x8 with each block's elements j and 16 + j side by side (the pairs the AVX2 nibble
      kernels multiply: one 16-bit broadcast per pair instead of two byte loads and a merge)
The rounding error is at most d/2 per element, i.e. 0.4% of the block's largest value.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .simd import f32, i32, rint_f32


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _block_scale(x, o, qmax):
    """(d, 1/d) for the 32-block at x[o]: d = max|x| / qmax, and 1/d = 0 for an all-zero block."""
    amax = f32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[o + j]))
    d = amax / qmax
    return d, (f32(1.0) / d if d > f32(0.0) else f32(0.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def quantize_row(x, x8, dx, sx, hs, x8p) -> None:
    """One row: x (K,) float32 -> x8/x8p (K,) int8, dx/sx (K/32,) float32, hs (K/16,) int32.
    Three passes, each a loop LLVM vectorises: one loop writing all five arrays was not, and ran many
    times slower (prefill quantizes every matmul's input, up to 512 x 8960 values)."""
    inv = np.empty(x.shape[0] // 32, np.float32)
    _scales(x, dx, inv)
    _round(x, inv, x8)
    _pairs_and_sums(x8, dx, sx, hs, x8p)


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _scales(x, dx, inv) -> None:
    for b in range(dx.shape[0]):
        dx[b], inv[b] = _block_scale(x, b * 32, f32(127.0))


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _round(x, inv, x8) -> None:
    for b in range(inv.shape[0]):
        ib = inv[b]
        for j in range(32):
            x8[b * 32 + j] = np.int8(i32(rint_f32(x[b * 32 + j] * ib)))


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _pairs_and_sums(x8, dx, sx, hs, x8p) -> None:
    for b in range(dx.shape[0]):
        o = b * 32
        s0 = i32(0)
        s1 = i32(0)
        for j in range(16):
            s0 += i32(x8[o + j])
            s1 += i32(x8[o + 16 + j])
            x8p[o + 2 * j] = x8[o + j]
            x8p[o + 2 * j + 1] = x8[o + 16 + j]
        sx[b] = dx[b] * f32(s0 + s1)
        hs[2 * b] = s0
        hs[2 * b + 1] = s1


@njit(cache=True)
def quantize_rows(x):
    """x (T, K) float32, K a multiple of 32 -> (x8, dx, sx, hs, x8p) as in `quantize_row`, a row per token."""
    t, k = x.shape
    x8 = np.empty((t, k), np.int8)
    x8p = np.empty((t, k), np.int8)
    dx = np.empty((t, k // 32), np.float32)
    sx = np.empty((t, k // 32), np.float32)
    hs = np.empty((t, k // 16), np.int32)
    out = (x8, dx, sx, hs, x8p)
    quantize_rows_into(x, out)
    return out


@njit(cache=True)
def quantize_rows_into(x, out) -> None:
    """quantize_rows into out = (x8, dx, sx, hs, x8p), arrays of its shapes (a step's reused buffers)."""
    x8, dx, sx, hs, x8p = out
    for i in range(x.shape[0]):
        quantize_row(x[i], x8[i], dx[i], sx[i], hs[i], x8p[i])


@njit(cache=True, fastmath=True, error_model="numpy")
def quantize_row16(x, x16, dx) -> None:
    """One row to int16 per 32-block: x16 = round(x / d), d = max|x| / 32767 (error <= d / 2, i.e.
    1/65534 of the block's largest value: for projections that need nearly float accuracy)."""
    for b in range(x.shape[0] // 32):
        o = b * 32
        d, inv = _block_scale(x, o, f32(32767.0))
        for j in range(32):
            x16[o + j] = np.int16(np.rint(x[o + j] * inv))
        dx[b] = d


@njit(cache=True)
def quantize_rows16(x):
    """x (T, K) float32 -> (x16 (T, K) int16, dx (T, K/32) float32), see quantize_row16."""
    t, k = x.shape
    x16 = np.empty((t, k), np.int16)
    dx = np.empty((t, k // 32), np.float32)
    quantize_rows16_into(x, x16, dx)
    return x16, dx


@njit(cache=True)
def quantize_rows16_into(x, x16, dx) -> None:
    for i in range(x.shape[0]):
        quantize_row16(x[i], x16[i], dx[i])


@njit(cache=True)
def with_residual(x, out) -> None:
    """out[:T] = x, out[T:] = x minus its 8-bit rounding: both passes of a near-float projection."""
    T, K = x.shape
    xq = quantize_rows(x)
    x8, dx = xq[0], xq[1]
    for t in range(T):
        for j in range(K):
            out[t, j] = x[t, j]
            out[T + t, j] = x[t, j] - f32(x8[t, j]) * dx[t, j // 32]
