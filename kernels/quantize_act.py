"""Activation quantization to 8 bits per 32-element block, rounded as ggml rounds them for llama.cpp.

The integer matmul kernels multiply the weights' small integers with these int8 activations and
accumulate in int16/int32; float scales are applied once per block.  Per block of 32 we keep:
  x8  the int8 values (|x8| <= 127: no int16 overflow later)
  dx  the block's scale d
  sx  d * sum(x8)          (for the weights' per-block minimum/offset terms)
  hs  sum(x8) of each 16-element half, int32 (Q6_K has one scale per 16 elements)
  x8p x8 with each block's elements j and 16 + j side by side (the pairs the AVX2 nibble
      kernels multiply: one 16-bit broadcast per pair instead of two byte loads and a merge)
The rounding (act_rounding.ROUND_*) is llama.cpp's for the weight: per 32 (Q8_0, Q8_1) or per 256
(Q8_K: the superblock's eight 32-blocks share d); the error is at most d/2 per element either way.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .act_rounding import ROUND_Q8_1, ROUND_Q8_K
from .simd import call_intrinsic, f16_to_f32, f32, f32_to_f16, i32, rint_f32

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)


@njit(cache=True, fastmath=True, error_model="numpy", inline="always")
def _block_scale(x, o, qmax):
    """(d, 1/d) for the 32-block at x[o]: d = max|x| * (1 / qmax) (the float32 reciprocal: what LLVM made
    of max|x| / qmax under fast-math, written out so every build and path rounds alike), and 1/d = 0 for
    an all-zero block."""
    amax = f32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[o + j]))
    d = amax * (f32(1.0) / qmax)
    return d, (f32(1.0) / d if d > f32(0.0) else f32(0.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def _amax(x, o, n):
    """max|x[o:o + n]| (exact in any order)."""
    m = f32(0.0)
    for j in range(n):
        m = max(m, abs(x[o + j]))
    return m


@njit(cache=True, error_model="numpy")
def block_scale(amax, superblock):
    """(d, 1/d as the quants use it) of a block whose largest magnitude is amax, as ggml computes them
    (see the module's docstring; IEEE divisions, no fast-math); (0, 0) for an all-zero block or one
    so small that 127 / amax overflows, and float32 d where ggml's float16 one would be inf."""
    inv = f32(127.0) / amax if amax > f32(0.0) else f32(0.0)
    if not inv < f32(np.inf):
        return f32(0.0), f32(0.0)
    if superblock:
        return (f32(1.0) / inv if inv > f32(0.0) else f32(0.0)), inv
    d = amax / f32(127.0)
    d16 = f16_to_f32(f32_to_f16(d))
    return (d16 if d16 < f32(np.inf) else d), inv


@njit(cache=True, error_model="numpy")
def q8_1_sum(amax, total):
    """Q8_1's sum term: float16(max|x| / 127 * sum(x8)) (float32 where float16 would be inf)."""
    s = (amax / f32(127.0)) * f32(total)
    s16 = f16_to_f32(f32_to_f16(s))
    return s16 if abs(s16) < f32(np.inf) else s


@njit(cache=True, error_model="numpy")
def quantize_row(x, x8, dx, sx, hs, x8p, rounding) -> None:
    """One row: x (K,) float32 -> x8/x8p (K,) int8, dx/sx (K/32,) float32, hs (K/16,) int32, in
    `rounding` (per 256 for ROUND_Q8_K where K allows, else per 32). Contiguous rows take
    quantize_block (a 32-block's five outputs in vector registers); others the scalar passes
    (quantize_row_loops), whose values are the same."""
    if x.strides[0] == 4 and x8.strides[0] == 1 and x8p.strides[0] == 1 and dx.strides[0] == 4 \
            and sx.strides[0] == 4 and hs.strides[0] == 4:  # fmt: skip
        xa, qa, pa = x.ctypes.data, x8.ctypes.data, x8p.ctypes.data
        da, sa, ha = dx.ctypes.data, sx.ctypes.data, hs.ctypes.data
        nb, step = x.shape[0] // 32, _blocks_per_scale(x.shape[0], rounding)
        for b0 in range(0, nb, step):
            amax = amax_256(xa + 128 * b0) if step > 1 else amax_32(xa + 128 * b0)
            d, inv = block_scale(amax, step > 1)
            for b in range(b0, b0 + step):
                quantize_block(
                    xa + 128 * b, qa + 32 * b, pa + 32 * b, da + 4 * b, sa + 4 * b, ha + 8 * b, d, inv
                )
            if rounding == ROUND_Q8_1 and inv > f32(0.0):
                sx[b0] = q8_1_sum(amax, hs[2 * b0] + hs[2 * b0 + 1])
    else:
        quantize_row_loops(x, x8, dx, sx, hs, x8p, rounding)


@njit(cache=True, inline="always")
def _blocks_per_scale(k, rounding):
    return 8 if rounding == ROUND_Q8_K and k % 256 == 0 else 1


@njit(cache=True, fastmath=True, error_model="numpy")
def quantize_row_loops(x, x8, dx, sx, hs, x8p, rounding) -> None:
    """quantize_row in three scalar passes (LLVM unrolls their 32-element loops and vectorises none:
    ~1 ns a value, 3x quantize_block's), for rows with gaps."""
    inv = np.empty(x.shape[0] // 32, np.float32)
    amax = np.empty(x.shape[0] // 32, np.float32)
    _scales(x, dx, inv, amax, _blocks_per_scale(x.shape[0], rounding))
    _round(x, inv, x8)
    _pairs_and_sums(x8, dx, sx, hs, x8p)
    if rounding == ROUND_Q8_1:
        for b in range(dx.shape[0]):
            if inv[b] > f32(0.0):
                sx[b] = q8_1_sum(amax[b], hs[2 * b] + hs[2 * b + 1])


def _ptr(builder: ir.IRBuilder, addr: ir.Value, ty: ir.Type) -> ir.Value:
    return builder.inttoptr(addr, ty.as_pointer())


def _block_max(builder: ir.IRBuilder, a: ir.Value) -> ir.Value:
    """The largest of the 32 lanes of a (no NaN expected: as _amax's max), by halving."""
    n = 32
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(a, a, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(a, a, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        a = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
    return builder.extract_element(a, ir.Constant(_I32, 0))


def _amax_of(blocks: int):
    """An intrinsic: max|x| of the `blocks` 32-blocks at address x, in vector registers (the values of
    _amax: a maximum is exact in any order)."""

    def amax(typingctx, xa):
        def codegen(context, builder, signature, args):
            v32f = ir.VectorType(_F32, 32)
            m = None
            for b in range(blocks):
                addr = builder.add(args[0], ir.Constant(_I64, 128 * b))
                v = call_intrinsic(
                    builder, "llvm.fabs.v32f32", v32f, [builder.load(_ptr(builder, addr, v32f), align=4)]
                )
                m = v if m is None else builder.select(builder.fcmp_ordered(">", v, m), v, m)
            return _block_max(builder, m)

        return types.float32(types.int64), codegen

    return intrinsic(amax)


amax_32, amax_256 = _amax_of(1), _amax_of(8)


def _half_sum(builder: ir.IRBuilder, q: ir.Value, first: int) -> ir.Value:
    """The int32 sum of lanes first .. first + 15 of the <32 x i8> q."""
    half = builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(_I32, 16), list(range(first, first + 16))))
    wide = builder.sext(half, ir.VectorType(_I32, 16))
    return call_intrinsic(builder, "llvm.vector.reduce.add.v16i32", _I32, [wide])


@intrinsic
def quantize_block(typingctx, x, x8, x8p, dx, sx, hs, d, inv):
    """One 32-block (addresses) at the scale d (float32, its quants' multiplier inv): the values of
    _round and _pairs_and_sums, in plain LLVM vector IR (any target): x8 = rint(x * inv), x8p its halves'
    lanes interleaved, hs the halves' sums, dx = d, sx = d * (their total), each rounded as they round."""

    def codegen(context, builder, signature, args):
        xa, qa, pa, da, sa, ha, d, inv = args
        v32f, v32i = ir.VectorType(_F32, 32), ir.VectorType(_I32, 32)
        v = builder.load(_ptr(builder, xa, v32f), align=4)
        splat = builder.insert_element(ir.Constant(v32f, ir.Undefined), inv, ir.Constant(_I32, 0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(v32i, [0] * 32))
        r = call_intrinsic(builder, "llvm.rint.v32f32", v32f, [builder.fmul(v, splat)])
        q = builder.trunc(builder.fptosi(r, v32i), ir.VectorType(_I8, 32))
        builder.store(q, _ptr(builder, qa, q.type), align=1)
        pairs = [i for j in range(16) for i in (j, 16 + j)]
        builder.store(
            builder.shuffle_vector(q, q, ir.Constant(v32i, pairs)), _ptr(builder, pa, q.type), align=1
        )
        s0, s1 = _half_sum(builder, q, 0), _half_sum(builder, q, 16)
        builder.store(s0, _ptr(builder, ha, _I32), align=4)
        builder.store(s1, _ptr(builder, builder.add(ha, ir.Constant(_I64, 4)), _I32), align=4)
        builder.store(d, _ptr(builder, da, _F32), align=4)
        total = builder.sitofp(builder.add(s0, s1), _F32)
        builder.store(builder.fmul(d, total), _ptr(builder, sa, _F32), align=4)
        return context.get_dummy_value()

    return types.void(*[types.int64] * 6, types.float32, types.float32), codegen


@njit(cache=True, error_model="numpy")
def _scales(x, dx, inv, amax, step) -> None:
    """Each 32-block's scale, multiplier and max|x|, shared by `step` blocks (1, or 8 for Q8_K)."""
    for b0 in range(0, dx.shape[0], step):
        m = _amax(x, b0 * 32, 32 * step)
        d, r = block_scale(m, step > 1)
        for b in range(b0, b0 + step):
            dx[b], inv[b], amax[b] = d, r, m


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
def quantize_rows(x, rounding):
    """x (T, K) float32, K a multiple of 32 -> (x8, dx, sx, hs, x8p) as in `quantize_row`, a row per token,
    in `rounding` (act_rounding.ROUND_*)."""
    t, k = x.shape
    x8 = np.empty((t, k), np.int8)
    x8p = np.empty((t, k), np.int8)
    dx = np.empty((t, k // 32), np.float32)
    sx = np.empty((t, k // 32), np.float32)
    hs = np.empty((t, k // 16), np.int32)
    out = (x8, dx, sx, hs, x8p)
    quantize_rows_into(x, out, rounding)
    return out


@njit(cache=True)
def quantize_rows_into(x, out, rounding) -> None:
    """quantize_rows into out = (x8, dx, sx, hs, x8p), arrays of its shapes (a step's reused buffers)."""
    x8, dx, sx, hs, x8p = out
    for i in range(x.shape[0]):
        quantize_row(x[i], x8[i], dx[i], sx[i], hs[i], x8p[i], rounding)


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
def with_residual(x, out, rounding) -> None:
    """out[:T] = x, out[T:] = x minus its 8-bit rounding in `rounding`: both passes of a near-float
    projection."""
    T, K = x.shape
    xq = quantize_rows(x, rounding)
    x8, dx = xq[0], xq[1]
    for t in range(T):
        for j in range(K):
            out[t, j] = x[t, j]
            out[T + t, j] = x[t, j] - f32(x8[t, j]) * dx[t, j // 32]
