"""The K kinds' float step, once per 256-element superblock instead of once per 32-block.

Q4_K/Q5_K weights are w = d * sc_j * q - dmin * m_j: fp16 (d, dmin) per superblock, 6-bit integers
(sc_j, m_j) per 32-block j.  With the activations' per-32 scales dx_j and sx_j = dx_j * sum(x8), a
row's dot product over one superblock is
    d * sum_j (sc_j * s_j) * dx_j  -  dmin * sum_j m_j * sx_j
where s_j is the block's integer sum of q * x8.  sc_j * s_j is an exact integer (< 2**24, so exact in
float32 too): per block and lane that is an integer multiply and two fused multiply-adds into two
float sums held in registers, and d, dmin are converted from fp16 and applied once per superblock.
Applying d * sc_j * dx_j per block (the scales_k form) cost as much as the integer sums themselves on
one-row decode (scripts/bench_row_tile.py).

Written as plain LLVM vector IR (no x86 intrinsics): the row and tile paths both call it, so a row's
bits do not depend on which path computed it, and it compiles for any target LLVM has.  Every lane
runs the same exact operations as `k_step_portable`, its scalar twin (tests compare them bit for bit).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .packing import TILE_ROWS as R
from .simd import EXACT_FP, HAVE_F16C, call_intrinsic, f16_to_f32, f32, fma_f32, i32

BLOCKS = 8  # 32-blocks per superblock
_LANES = 16  # lanes per vector: one 512-bit register, two 256-bit ones
_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_VF, _VI = ir.VectorType(_F32, _LANES), ir.VectorType(_i32, _LANES)
_ZERO = ir.Constant(_VF, [0.0] * _LANES)
_SIG = types.void(*[types.int64] * 9)


def _load(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value | int, elem: ir.Type) -> ir.Value:
    """<16 x elem> at byte address base + offset."""
    off = offset if isinstance(offset, ir.Value) else ir.Constant(_i64, offset)
    ptr = builder.inttoptr(builder.add(base, off), ir.VectorType(elem, _LANES).as_pointer())
    return builder.load(ptr, align=1)


def _splat(builder: ir.IRBuilder, addr: ir.Value, offset: int) -> ir.Value:
    """The float32 at addr + offset in every lane."""
    ptr = builder.inttoptr(builder.add(addr, ir.Constant(_i64, offset)), _F32.as_pointer())
    one = builder.insert_element(ir.Constant(_VF, ir.Undefined), builder.load(ptr), ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, ir.Constant(_VF, ir.Undefined), ir.Constant(_VI, [0] * _LANES))


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return call_intrinsic(builder, f"llvm.fma.v{_LANES}f32", _VF, [a, b, c])


def _sum16(builder, s, stride, j, g, parts):
    """Block j's int32 sums of lanes g*16.. from int16 parts (s0 + s1 [+ 16 * s2]) or one int32 part."""
    lane_bytes = 4 if parts == 0 else 2
    at = builder.add(builder.mul(stride, ir.Constant(_i64, j)), ir.Constant(_i64, g * _LANES * lane_bytes))
    if parts == 0:
        return _load(builder, s[0], at, _i32)
    v = [builder.sext(_load(builder, s[i], at, _i16), _VI) for i in range(parts)]
    total = builder.add(v[0], v[1])
    return builder.add(total, builder.shl(v[2], ir.Constant(_VI, [4] * _LANES))) if parts == 3 else total


def _half_to_float(builder: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """<16 x i16> fp16 bits -> float32, exact: `fpext` where the CPU has F16C, else in integers as
    simd.f16_to_f32_soft (`fpext half` would be a libcall the JIT cannot link)."""
    if HAVE_F16C:
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), _LANES)), _VF)

    def c(v):
        return ir.Constant(_VI, [v] * _LANES)

    b = builder.zext(h, _VI)
    sign = builder.shl(builder.and_(b, c(0x8000)), c(16))
    e = builder.and_(builder.lshr(b, c(10)), c(0x1F))
    m = builder.and_(b, c(0x3FF))
    normal = builder.or_(builder.shl(builder.add(e, c(112)), c(23)), builder.shl(m, c(13)))
    sub = builder.bitcast(builder.fmul(builder.uitofp(m, _VF), ir.Constant(_VF, [2.0**-24] * _LANES)), _VI)
    bits = builder.select(builder.icmp_unsigned("!=", e, c(0)), normal, sub)
    return builder.bitcast(builder.or_(bits, sign), _VF)


def _lane_group(builder, args, g, parts):
    """Lanes g*16 .. g*16+15 of one superblock: acc = fma(d, t, fma(-dmin, u, acc))."""
    s, stride, sm, f0, dx, sx, acc = args[0:3], args[3], *args[4:]
    t, u = _ZERO, _ZERO
    for j in range(BLOCKS):
        si = _sum16(builder, s, stride, j, g, parts)
        sc = builder.zext(_load(builder, sm, j * 2 * R + g * _LANES, _i8), _VI)
        mn = builder.zext(_load(builder, sm, j * 2 * R + R + g * _LANES, _i8), _VI)
        t = _fma(builder, builder.sitofp(builder.mul(sc, si), _VF), _splat(builder, dx, 4 * j), t)
        u = _fma(builder, builder.uitofp(mn, _VF), _splat(builder, sx, 4 * j), u)
    d = _half_to_float(builder, _load(builder, f0, g * _LANES * 2, _i16))
    dmin = _half_to_float(builder, _load(builder, f0, 2 * R + g * _LANES * 2, _i16))
    a = _load(builder, acc, g * _LANES * 4, _F32)
    a = _fma(builder, d, t, _fma(builder, builder.fsub(ir.Constant(_VF, [-0.0] * _LANES), dmin), u, a))
    ptr = builder.inttoptr(builder.add(acc, ir.Constant(_i64, g * _LANES * 4)), _VF.as_pointer())
    builder.store(a, ptr, align=1)


def _make(parts: int):
    def step(typingctx, s0, s1, s2, stride, sm, f0, dx, sx, acc):
        def codegen(context, builder, signature, args):
            for g in range(R // _LANES):
                _lane_group(builder, args, g, parts)
            return context.get_dummy_value()

        return _SIG, codegen

    return intrinsic(step)


# (s0, s1, s2, stride, sm, f0, dx, sx, acc), all byte addresses / counts.  Block j's sums of the R
# lanes start at s + j * stride; sm: the first block's (sc, m) rows (R uint8 each, blocks 2R apart);
# f0: the superblock's (d, dmin) rows of fp16 bits; dx, sx: the first block's float32 scales; acc: R
# float32, updated.
k_step_pairs = _make(2)  # int16 s0 + s1 (4-bit kinds' two half sums; s2 unused)
k_step_five = _make(3)  # int16 s0 + s1 + 16 * s2 (fifth-bit kinds)
k_step_sums = _make(0)  # int32 sums at s0 (s1, s2 unused)


@njit(cache=True, fastmath=EXACT_FP, error_model="numpy")
def k_step_portable(s32, sm, f0, dx, sx, acc) -> None:
    """Scalar twin of the k_step intrinsics: s32 (8, R) int32 block sums, sm (8, 2, R) uint8,
    f0 (2, R) uint16 fp16 bits, dx/sx (8,) float32, acc (R,) float32 updated."""
    for r in range(R):
        t, u = f32(0.0), f32(0.0)
        for j in range(BLOCKS):
            t = fma_f32(f32(i32(sm[j, 0, r]) * s32[j, r]), dx[j], t)
            u = fma_f32(f32(sm[j, 1, r]), sx[j], u)
        acc[r] = fma_f32(f16_to_f32(f0[0, r]), t, fma_f32(-f16_to_f32(f0[1, r]), u, acc[r]))
