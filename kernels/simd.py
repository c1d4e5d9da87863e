"""Scalar building blocks that let LLVM vectorise the kernels the way we intend.

Numba widens every small-integer operation to int64 (int16 + int16 -> int64), and LLVM then picks
64-bit vector lanes: four products per AVX2 instruction instead of sixteen.  These intrinsics emit
the LLVM instruction at the width we ask for (wrapping, like C), so an int16 multiply-accumulate
over a loop becomes `vpmullw`/`vpaddw` on 16 lanes.  They are plain LLVM IR, so they work on any
target LLVM supports (no x86-specific intrinsics).

Also here: fp16 -> fp32 (Numba has no float16 on the CPU) and a vectorisable `exp`.

Kernels use error_model="numpy": with Numba's default ("python") every float division checks for
a zero divisor to raise ZeroDivisionError, and that branch stops LLVM from vectorising the loop.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

i16, i32, f32 = np.int16, np.int32, np.float32


def call_intrinsic(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """Call the LLVM intrinsic `name` (declared once per module from the arguments' types): llvmlite's
    declare_intrinsic does not spell vector types into the name, and x86 intrinsics take none."""
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _wrapping_binop(op: str, ty: types.Integer):
    @intrinsic
    def binop(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])

        return ty(ty, ty), codegen

    return binop


add16 = _wrapping_binop("add", types.int16)
mul16 = _wrapping_binop("mul", types.int16)
add32 = _wrapping_binop("add", types.int32)
mul32 = _wrapping_binop("mul", types.int32)


@intrinsic
def i32_as_f32(typingctx, x):
    """Reinterpret the bits of an int32 as a float32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_TWO_POW_M24 = f32(2.0**-24)


def _host_has(feature: str) -> bool:
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get(feature, False))
    except Exception:  # unknown host: portable code
        return False


HAVE_F16C = _host_has("f16c")


@intrinsic
def _f16_to_f32_hw(typingctx, h):
    """fp16 bits -> float32 as LLVM's `fpext half`: one vcvtph2ps per 8 values with F16C (only
    used where the host has it; elsewhere LLVM would need a libm helper Numba cannot link)."""

    def codegen(context, builder, signature, args):
        bits = builder.trunc(args[0], ir.IntType(16)) if args[0].type.width > 16 else args[0]
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@njit(inline="always")
def f16_to_f32(h):
    """IEEE half bits (any integer type of >= 16 bits) -> float32, exact (F16C where present)."""
    if HAVE_F16C:
        return _f16_to_f32_hw(h)
    return f16_to_f32_soft(h)


@njit(inline="always")
def f16_to_f32_soft(h):
    """IEEE half bits (any integer type) -> float32, exact for normal and subnormal numbers.

    Normal numbers are re-biased in the integer domain (exponent + 112).  Scaling by 2**112 in float
    instead looked simpler, but fastmath lets LLVM reassociate `f16_to_f32(d) * dx * s` into
    `bits * (2**112 * dx * s)`, which overflows for large activations (inf * tiny = NaN).
    fp16 inf/nan become large finite numbers: scales in valid GGUF files are never inf/nan.
    """
    b = i32(h) & 0xFFFF
    sign = (b & 0x8000) << 16
    e = (b >> 10) & 0x1F
    m = b & 0x3FF
    normal = i32_as_f32(i32(sign | ((e + 112) << 23) | (m << 13)))
    sub = f32(m) * _TWO_POW_M24  # subnormal or zero: m * 2**-24
    return normal if e != 0 else (-sub if sign else sub)


@intrinsic
def _f32_as_i32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _f32_to_f16_hw(typingctx, x):
    """float32 -> IEEE half bits as LLVM's `fptrunc half` (vcvtps2ph with F16C: round to nearest even)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always")
def f32_to_f16(x):
    """float32 -> IEEE half bits (uint16), rounded to nearest even like numpy's astype(float16)."""
    if HAVE_F16C:
        return _f32_to_f16_hw(f32(x))
    return f32_to_f16_soft(f32(x))


@njit(inline="always")
def f32_to_f16_soft(x):
    """The same in integer arithmetic: re-bias the exponent, round the mantissa to 10 bits (a carry
    may bump the exponent, which is right), subnormals by rint(|x| * 2**24), overflow to inf."""
    b = _f32_as_i32(x)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf or nan
        return np.uint16(sign | 0x7C00 | (0x200 if a > 0x7F800000 else 0))
    if a >= 0x477FF000:  # rounds past 65504
        return np.uint16(sign | 0x7C00)
    if a < 0x38800000:  # below 2**-14: a half subnormal (or zero)
        return np.uint16(sign | i32(np.rint(abs(x) * f32(16777216.0))))
    e = a - 0x38000000
    return np.uint16(sign | ((e + 0xFFF + ((e >> 13) & 1)) >> 13))


@njit(inline="always")
def bf16_to_f32(h):
    """bfloat16 bits -> float32: they are the top half of a float32."""
    return i32_as_f32(i32((i32(h) & 0xFFFF) << 16))


_LOG2E = f32(1.4426950408889634)
_LN2_HI = f32(0.693359375)
_LN2_LO = f32(-2.12194440e-4)


@njit(inline="always", fastmath=True)
def fast_exp(x):
    """float32 exp with ~2 ulp error, written so LLVM vectorises it (libm's expf is a scalar call).

    Cephes-style: x = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2**n built from
    the exponent bits.  Inputs are clamped to [-87, 88] (the float32 range); exp(-inf) gives ~0.
    """
    x = min(max(x, f32(-87.0)), f32(88.0))
    n = np.floor(x * _LOG2E + f32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = f32(1.9875691500e-4)
    p = p * r + f32(1.3981999507e-3)
    p = p * r + f32(8.3334519073e-3)
    p = p * r + f32(4.1665795894e-2)
    p = p * r + f32(1.6666665459e-1)
    p = p * r + f32(5.0000001201e-1)
    p = p * r * r + r + f32(1.0)
    return p * i32_as_f32(i32((i32(n) + 127) << 23))


# ---- raw pointers: per-kind kernels are C callbacks taking an int64 argument vector ---------------


def _pointer_cast(dtype: types.Type):
    @intrinsic
    def cast(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(dtype)))

        return types.CPointer(dtype)(types.int64), codegen

    return cast


ptr_u8 = _pointer_cast(types.uint8)
ptr_i8 = _pointer_cast(types.int8)
ptr_u16 = _pointer_cast(types.uint16)
ptr_i16 = _pointer_cast(types.int16)
ptr_i32 = _pointer_cast(types.int32)
ptr_i64 = _pointer_cast(types.int64)
ptr_f32 = _pointer_cast(types.float32)

# The C signature of every range kernel: void kernel(int64 *argv, int64 lo, int64 hi).
RANGE_KERNEL_SIG = types.void(types.CPointer(types.int64), types.int64, types.int64)


@intrinsic
def call_range_kernel(typingctx, fn_addr, argv_addr, lo, hi):
    """Call the range kernel at address fn_addr (see RANGE_KERNEL_SIG) with argv at argv_addr."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64.as_pointer(), i64, i64])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fn, [builder.inttoptr(args[1], i64.as_pointer()), args[2], args[3]])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def fetch_add(typingctx, addr, value):
    """Atomically add value to the int64 at addr and return its old value: threads take the next
    piece of work from a shared counter."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at addr (`llvm.prefetch`: read, keep in all levels); never faults."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        flags = [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)]
        call_intrinsic(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ptr, *flags])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def rint_f32(typingctx, x):
    """Round to nearest, ties to even (np.rint) as LLVM's `llvm.rint`: one vrndscaleps / vroundps per
    vector where the CPU has it, so loops around it vectorise (Numba's np.rint is a libm call)."""

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.rint", [ir.FloatType()])
        return builder.call(fn, [args[0]])

    return types.float32(types.float32), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c rounded once (`llvm.fma`: one vfmadd per vector where the CPU has FMA)."""

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.fma", [ir.FloatType()] * 3)
        return builder.call(fn, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


# fastmath for float code whose bits must not depend on where LLVM compiled it.  Numba links a copy
# of every callee into each caller's module and optimises it again there; the process runs
# whichever copy of a symbol it loaded first: the callee's own when compiling afresh, the caller's
# copy when loading from the on-disk cache.  With `reassoc`/`contract` the copies may round
# differently (seen: the int matmul's scale step, cold vs cached, up to 2e-7 relative), so these
# flags keep only those that cannot change a finite result; FMAs are written out (fma_f32).
EXACT_FP = {"nnan", "ninf", "nsz"}
