"""float32 GEMM micro-kernels: y[t, n0 + r] = dot(x[t], w[r]) for a dequantized tile w (rows, K).

The float path's kernel (matmul.float_range): for the kinds without an integer kernel (F32, F16,
BF16, Q2_K, Q3_K) the tile is dequantized once and then costs nothing per activation row (prefill,
big batches).  Each micro-kernel keeps a 3x3 block of dot products in registers while streaming
over K, so every loaded vector feeds three FMAs; LLVM vectorises the K loop (8 lanes) and reduces
horizontally once at the end.  fastmath is needed for that vectorisation (it reorders the
sums), and is safe: only summation order changes.
"""

from __future__ import annotations

import functools

from numba import carray, cfunc, njit

from .simd import RANGE_KERNEL_SIG, call_range_kernel, f32, ptr_f32


@njit(cache=True, fastmath=True, error_model="numpy")
def mk_3x3(x, w, y, t, r, n0) -> None:
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = f32(0.0)
    for k in range(x.shape[1]):
        w0, w1, w2 = w[r, k], w[r + 1, k], w[r + 2, k]
        x0, x1, x2 = x[t, k], x[t + 1, k], x[t + 2, k]
        a00 += x0 * w0
        a01 += x0 * w1
        a02 += x0 * w2
        a10 += x1 * w0
        a11 += x1 * w1
        a12 += x1 * w2
        a20 += x2 * w0
        a21 += x2 * w1
        a22 += x2 * w2
    y[t, n0 + r], y[t, n0 + r + 1], y[t, n0 + r + 2] = a00, a01, a02
    y[t + 1, n0 + r], y[t + 1, n0 + r + 1], y[t + 1, n0 + r + 2] = a10, a11, a12
    y[t + 2, n0 + r], y[t + 2, n0 + r + 1], y[t + 2, n0 + r + 2] = a20, a21, a22


@njit(cache=True, fastmath=True, error_model="numpy")
def mk_1x3(x, w, y, t, r, n0) -> None:
    a0 = a1 = a2 = f32(0.0)
    for k in range(x.shape[1]):
        xv = x[t, k]
        a0 += xv * w[r, k]
        a1 += xv * w[r + 1, k]
        a2 += xv * w[r + 2, k]
    y[t, n0 + r], y[t, n0 + r + 1], y[t, n0 + r + 2] = a0, a1, a2


@njit(cache=True, fastmath=True, error_model="numpy")
def mk_3x1(x, w, y, t, r, n0) -> None:
    a0 = a1 = a2 = f32(0.0)
    for k in range(x.shape[1]):
        wv = w[r, k]
        a0 += x[t, k] * wv
        a1 += x[t + 1, k] * wv
        a2 += x[t + 2, k] * wv
    y[t, n0 + r], y[t + 1, n0 + r], y[t + 2, n0 + r] = a0, a1, a2


@njit(cache=True, fastmath=True, error_model="numpy")
def mk_1x1(x, w, y, t, r, n0) -> None:
    a = f32(0.0)
    for k in range(x.shape[1]):
        a += x[t, k] * w[r, k]
    y[t, n0 + r] = a


@njit(cache=True, fastmath=True, error_model="numpy")
def gemm_tile(x, w, rows, y, n0) -> None:
    """y[:, n0:n0+rows] = x @ w[:rows].T, in 3x3 blocks plus edges."""
    T = x.shape[0]
    t = 0
    while t + 3 <= T:
        r = 0
        while r + 3 <= rows:
            mk_3x3(x, w, y, t, r, n0)
            r += 3
        for r2 in range(r, rows):
            mk_3x1(x, w, y, t, r2, n0)
        t += 3
    for t2 in range(t, T):
        r = 0
        while r + 3 <= rows:
            mk_1x3(x, w, y, t2, r, n0)
            r += 3
        for r2 in range(r, rows):
            mk_1x1(x, w, y, t2, r2, n0)


# ---- a C callback, so the range kernel of every weight kind calls one compiled copy ---------------
# (Inlining it into each kind's kernel would make LLVM re-optimise these loops once per kind.)

GEMM_ARGV_LEN = 8


@njit(cache=True)
def _gemm_body(argv, lo, hi) -> None:
    T, K, rows, N = argv[1], argv[2], argv[4], argv[6]
    x = carray(ptr_f32(argv[0]), (T, K))
    w = carray(ptr_f32(argv[3]), (rows, K))
    y = carray(ptr_f32(argv[5]), (T, N))
    gemm_tile(x, w, rows, y, argv[7])


@functools.cache
def gemm_kernel():
    """The compiled C callback (kept alive here).  Its address is passed to kernels at run time:
    a constant address would be frozen into Numba's on-disk cache."""

    def gemm(argv, lo, hi):
        _gemm_body(argv, lo, hi)

    return cfunc(RANGE_KERNEL_SIG, cache=True)(gemm)


@njit(cache=True)
def call_gemm(gemm_addr, argv, x_addr, T, K, w, rows, y_addr, N, n0) -> None:
    """y[:, n0:n0+rows] = x @ w[:rows].T through the shared compiled GEMM (argv: scratch of 8)."""
    argv[0], argv[1], argv[2], argv[3] = x_addr, T, K, w.ctypes.data
    argv[4], argv[5], argv[6], argv[7] = rows, y_addr, N, n0
    call_range_kernel(gemm_addr, argv.ctypes.data, 0, 0)
