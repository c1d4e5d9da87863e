"""GEMV and GEMM for the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4), block by block:
each step takes a (rows, blocks, bytes) tile of quants, contiguous per row (16-byte loads once
pointers are aligned), reads each block's scale (and min) once, and x once per tile, broadcast over
the rows (so a thread that holds several rows reuses its x registers).

The GEMM forms the values themselves, exactly as quant/ggml.py does, and meets x in tensor-core
dots. In the GEMV, per block the sum is d * sum(q * x) (Q4_1/Q5_1: + m * sum(x)), as llama.cpp's
decode kernels form it: the same products as dequantize-then-multiply, summed in another float32
order (within the tests' float32 rounding bound). Quants become floats through their bits (2^23 + q
as a float's pattern, minus 2^23), an integer op and a float subtraction instead of a slow
int-to-float convert; exact for the small integers they are.

Planes (weights.py), as p0..p2: Q4_0 (d, qs), Q4_1 (dm, qs), Q5_0 (d, qh, qs), Q5_1 (dm, qh, qs),
Q8_0 (d, qs), MXFP4 (e, qs). QT is triton_quant.QTYPE_IDS' (0..4; MXFP4 8). MXFP4's value is
2^(e - 128) times a doubled E2M1 code (quant/ggml.py's e8m0_half and MXFP4_VALUES), both formed from
bits (e8m0_half, e2m1_float): exact, so the GEMM's weights are the oracle's. Each program owns a
range of blocks (split-K) and writes its partial sums to out[split] (the caller adds them).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # the float 2^23: its low 23 bits are an integer's exact place


@triton.jit
def _small_float(q, bias: tl.constexpr):
    """q - bias as float32 for int32 0 <= q < 2^23, exactly."""
    return (q | MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def e8m0_half(e):
    """E8M0 exponent bytes -> float32 2^(e - 128), built from the bits (e < 2 are subnormal)."""
    e = e.to(tl.int32)
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_biased(c):
    """E2M1 codes (int32 0..15) -> their doubled values (MXFP4_VALUES, -12..12) plus 12."""
    ex = (c >> 1) & 3
    mant = c & 1
    mag = tl.where(ex == 0, mant, (2 + mant) << tl.maximum(ex - 1, 0))
    return tl.where(c >= 8, 12 - mag, 12 + mag)


TWO_127 = tl.constexpr(2.0**127)


@triton.jit
def e2m1_float(c):
    """E2M1 codes (int32 0..15) -> their doubled values (MXFP4_VALUES) as float32, in five integer ops
    and a multiply (e2m1_biased takes fifteen ops): the code's three magnitude bits placed at a
    float's lowest two exponent bits and top mantissa bit make 2^-127 times the doubled value, as
    E2M1's own zero exponent is a subnormal one (codes 1 and 9 become float32 subnormals); the sign
    bit goes to the float's; times 2^127, exactly. It needs subnormals kept: PTX's mul.f32 keeps
    them (test_torch_quant checks that no .ftz op is emitted). Code 8 gives -0.0, which no sum or
    product tells from 0.0."""
    return (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * TWO_127


@triton.jit
def _block_dots(p0, p1, p2, b, xb, valid, QT: tl.constexpr):
    """(BN, BB) scaled dot products of blocks b (BN, BB) with x at xb (BB,) pointers to each block's
    first value; `valid` (BB,) False blocks count zero. x is loaded 2-D and then broadcast over the
    rows: a 3-D load would get a layout of its own, and Triton would move the whole weight tile
    through shared memory to meet it."""
    b3 = b[:, :, None]
    if QT == 4:  # Q8_0: 32 signed bytes
        j = tl.arange(0, 32)
        q = tl.load(p1 + b3 * 32 + j[None, None, :]).to(tl.int32)
        x = tl.load(xb[:, None] + j[None, :], mask=valid[:, None], other=0.0)
        return tl.load(p0 + b).to(tl.float32) * tl.sum(_small_float(q + 128, 128) * x[None, :, :], axis=2)
    j = tl.arange(0, 16)
    if QT == 2 or QT == 3:  # Q5: bit j of qh is value j's fifth bit
        q = tl.load(p2 + b3 * 16 + j[None, None, :]).to(tl.int32)
        h = tl.load(p1 + b)[:, :, None]
        lo = (q & 15) | (((h >> j[None, None, :]) & 1) << 4)
        hi = (q >> 4) | (((h >> (j[None, None, :] + 16)) & 1) << 4)
    else:
        q = tl.load(p1 + b3 * 16 + j[None, None, :]).to(tl.int32)
        lo, hi = q & 15, q >> 4
    x_lo = tl.load(xb[:, None] + j[None, :], mask=valid[:, None], other=0.0)
    x_hi = tl.load(xb[:, None] + 16 + j[None, :], mask=valid[:, None], other=0.0)
    if QT == 8:  # MXFP4: 2^(e - 128) * the doubled E2M1 values
        # (new names: Triton still builds the statements after a constexpr branch's return)
        w_lo, w_hi = e2m1_float(lo), e2m1_float(hi)
        return e8m0_half(tl.load(p0 + b)) * tl.sum(w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :], axis=2)
    if QT == 0:  # d * (q - 8)
        return tl.load(p0 + b).to(tl.float32) * _pair_sum(lo, hi, x_lo, x_hi, 8)
    if QT == 2:  # d * (q - 16)
        return tl.load(p0 + b).to(tl.float32) * _pair_sum(lo, hi, x_lo, x_hi, 16)
    d = tl.load(p0 + 2 * b).to(tl.float32)  # d * q + m
    m = tl.load(p0 + 2 * b + 1).to(tl.float32)
    return d * _pair_sum(lo, hi, x_lo, x_hi, 0) + m * tl.sum(x_lo + x_hi, axis=1)[None, :]


@triton.jit
def _pair_sum(lo, hi, x_lo, x_hi, bias: tl.constexpr):
    return tl.sum(
        _small_float(lo, bias) * x_lo[None, :, :] + _small_float(hi, bias) * x_hi[None, :, :], axis=2
    )


@triton.jit(do_not_specialize=["blocks_per_split"])  # one compile for any split size
def gemv_legacy_kernel(x_ptr, out_ptr, p0, p1, p2, N, nb, stride_xm, blocks_per_split,
                       QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    """out[split, m, n] = this split's blocks of row n dotted with x row m, BLOCK_B blocks a step;
    grid (row tiles, splits, x rows)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (tl.minimum(rn, N - 1).to(tl.int64) * nb)[:, None]
    xs = x_ptr + tl.program_id(2) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    last = tl.minimum(nb, first + blocks_per_split)
    for b0 in range(first, last, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        b = row + tl.minimum(blk, nb - 1)[None, :]  # clamped: a real block, its x masked to zero
        acc += _block_dots(p0, p1, p2, b, xs + blk * 32, blk < last, QT)
    out = out_ptr + (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * N + rn
    tl.store(out, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _block_values(p0, p1, p2, b, QT: tl.constexpr):
    """Blocks b (BN, BB) as (values 0-15, values 16-31), (BN, BB, 16) float32 each, as quant/ggml.py
    forms them: d * (q - 8 or 16), d * q and MXFP4's are exact products, d * q + m rounds once (fused
    or not)."""
    b3 = b[:, :, None]
    j = tl.arange(0, 16)[None, None, :]
    if QT == 4:  # Q8_0: d * q
        d = tl.load(p0 + b3).to(tl.float32)
        lo = tl.load(p1 + b3 * 32 + j).to(tl.int32) + 128
        hi = tl.load(p1 + b3 * 32 + 16 + j).to(tl.int32) + 128
        return d * _small_float(lo, 128), d * _small_float(hi, 128)
    if QT == 2 or QT == 3:
        q = tl.load(p2 + b3 * 16 + j).to(tl.int32)
        h = tl.load(p1 + b)[:, :, None]
        lo = (q & 15) | (((h >> j) & 1) << 4)
        hi = (q >> 4) | (((h >> (j + 16)) & 1) << 4)
    else:
        q = tl.load(p1 + b3 * 16 + j).to(tl.int32)
        lo, hi = q & 15, q >> 4
    if QT == 8:  # MXFP4: exact products (a power of two times a small integer)
        d = e8m0_half(tl.load(p0 + b3))
        return d * e2m1_float(lo), d * e2m1_float(hi)
    if QT == 0 or QT == 2:
        d = tl.load(p0 + b3).to(tl.float32)
        if QT == 0:
            return d * _small_float(lo, 8), d * _small_float(hi, 8)
        return d * _small_float(lo, 16), d * _small_float(hi, 16)
    d = tl.load(p0 + 2 * b3).to(tl.float32)
    m = tl.load(p0 + 2 * b3 + 1).to(tl.float32)
    return d * _small_float(lo, 0) + m, d * _small_float(hi, 0) + m


@triton.jit(do_not_specialize=["blocks_per_split"])
def gemm_legacy_kernel(x_ptr, out_ptr, p0, p1, p2, M, N, nb, stride_xm, blocks_per_split,
                       QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_B: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out[split, m, n] for a (BLOCK_M, BLOCK_N) tile, BLOCK_B blocks a step: their values 0-15 and
    16-31 in two tensor-core dots against the x columns they pair with; grid (m tiles, n tiles,
    splits)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (tl.minimum(rn, N - 1).to(tl.int64) * nb)[:, None]
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    c = tl.arange(0, BLOCK_B * 16)  # a step's columns: block c // 16, value c % 16 (+16: hi)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    last = tl.minimum(nb, first + blocks_per_split)
    for b0 in range(first, last, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        w_lo, w_hi = _block_values(p0, p1, p2, row + tl.minimum(blk, nb - 1)[None, :], QT)
        xo = (b0 + c // 16) * 32 + c % 16
        mask = (b0 + c // 16 < last)[None, :]
        x_lo = tl.load(xs + xo[None, :], mask=mask, other=0.0)
        x_hi = tl.load(xs + 16 + xo[None, :], mask=mask, other=0.0)
        w_lo = tl.reshape(w_lo, (BLOCK_N, BLOCK_B * 16))
        w_hi = tl.reshape(w_hi, (BLOCK_N, BLOCK_B * 16))
        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    out = out_ptr + (tl.program_id(2) * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
