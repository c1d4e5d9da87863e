"""LLVM IR for the q8_0 KV cache's int8 rows (Numba intrinsics; portable but for one AVX2 path).

A Numba loop over 32 int8 values stays scalar (each index is checked and wrapped, which hides the
32 adjacent loads from LLVM's vectorisers); these say `load <32 x i8>` outright.  The int8 dot uses
AVX2's vpmaddubsw where the host has it (as ggml does) and plain vector IR elsewhere, with the same
integer sums, so the same bits.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import HAVE_F16C, _host_has

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V32I32, _V8I32 = ir.VectorType(_I8, 32), ir.VectorType(_I32, 32), ir.VectorType(_I32, 8)
_V8F, _V32F = ir.VectorType(_F32, 8), ir.VectorType(_F32, 32)
Q8_BYTES = 34
HAVE_AVX2 = _host_has("avx2")


def _c_arrays(dtype: types.Type, *arys) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C" for a in arys)


def _at(context, builder, aryty, ary, idx, ty: ir.Type) -> ir.Value:
    """A ty* at flat element idx of a C-contiguous array (unchecked)."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [idx]), ty.as_pointer())


def _call(builder, name: str, ret: ir.Type, args: list) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, x: ir.Value, vty: ir.VectorType) -> ir.Value:
    v = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, vty.count), None))


def _pick(builder, v: ir.Value, first: int, step: int) -> ir.Value:
    n = v.type.count // step
    return builder.shuffle_vector(
        v, v, ir.Constant(ir.VectorType(_I32, n), list(range(first, v.type.count, step)))
    )


def _quad_sums(builder, k8: ir.Value, q8: ir.Value, avx2: bool) -> ir.Value:
    """<8 x i32> lane l = sum_e<4 k[4l + e] * q[4l + e] of two <32 x i8> (exact; the lanes ggml's AVX2
    dot forms).  AVX2: |k| (unsigned) times q with k's sign, vpmaddubsw into int16 pairs (at most
    2 * 128 * 127: no saturation, the query's quants being within +-127), vpmaddwd by ones; elsewhere
    the same sums in plain IR (even/odd products added in pairs: the shape LLVM lowers to vpmaddwd)."""
    if avx2:
        v16 = ir.VectorType(_I16, 16)
        absk = _call(builder, "llvm.abs.v32i8", _V32I8, [k8, ir.Constant(ir.IntType(1), 0)])
        signed_q = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [q8, k8])
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [absk, signed_q])
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [pairs, ir.Constant(v16, [1] * 16)])
    k, q = builder.sext(k8, _V32I32), builder.sext(q8, _V32I32)
    pairs = builder.add(
        builder.mul(_pick(builder, k, 0, 2), _pick(builder, q, 0, 2)),
        builder.mul(_pick(builder, k, 1, 2), _pick(builder, q, 1, 2)),
    )
    return builder.add(_pick(builder, pairs, 0, 2), _pick(builder, pairs, 1, 2))


def _hsum8(builder, acc: ir.Value) -> ir.Value:
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)), as three vector adds
    (plain fadds: no fast-math flags, so LLVM keeps this order)."""

    def half(v: ir.Value, idx: list[int]) -> ir.Value:
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 4), idx))

    r = builder.fadd(half(acc, [4, 5, 6, 7]), half(acc, [0, 1, 2, 3]))
    r = builder.fadd(r, half(r, [2, 3, 2, 3]))
    r = builder.fadd(r, half(r, [1, 1, 3, 3]))
    return builder.extract_element(r, ir.Constant(_I32, 0))


def _key_block(builder, at, k0v, b):
    """Block b of the key row at flat byte k0v: its <32 x i8> quants."""
    ko = builder.add(k0v, builder.mul(b, ir.Constant(k0v.type, Q8_BYTES)))
    return builder.load(at("k", builder.add(ko, ir.Constant(ko.type, 2)), _V32I8), align=1)


def _dim(context, builder, aryty, ary, i: int) -> ir.Value:
    return cgutils.unpack_tuple(builder, context.make_array(aryty)(context, builder, ary).shape)[i]


def _key_scale(builder, at, k0v, b, f16c: bool) -> ir.Value:
    """Block b's d_key: from its f16 bytes (one vcvtph2ps) where the CPU has F16C, else from kd."""
    if not f16c:
        return builder.load(at("kd", b, _F32))
    ko = builder.add(k0v, builder.mul(b, ir.Constant(k0v.type, Q8_BYTES)))
    return builder.fpext(builder.bitcast(builder.load(at("k", ko, _I16), align=1), ir.HalfType()), _F32)


def _row_dot(avx2: bool):
    @intrinsic
    def q8_dot_row(typingctx, keys, k0, kd, qq, q0, qd, d0):
        """The q8_0 key row at flat byte k0 of keys (kd: its block scales as float32, filled by the caller
        only where the CPU lacks F16C, as there a half-float fpext would be a libcall) . the quantized
        query at qq[q0] (its block scales from qd[d0]), as ggml_vec_dot_q8_0_q8_0 on AVX2: per
        block, 8 lanes of 4-product int32 sums, converted to float and fused-multiply-added with
        (d_key * d_query) into 8 float lanes, summed at the end in hsum_float_8's order: llama.cpp's
        score, bit for bit."""
        if not (_c_arrays(types.int8, keys, qq) and _c_arrays(types.float32, kd, qd)):
            return None

        def codegen(context, builder, signature, args):
            kary, k0v, kdary, qary, q0v, dary, d0v = args
            arrays = {"k": (keys, kary), "kd": (kd, kdary), "q": (qq, qary), "d": (qd, dary)}

            def at(name, idx, ty):
                return _at(context, builder, *arrays[name], idx, ty)

            acc = cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8))
            with cgutils.for_range(builder, _dim(context, builder, kd, kdary, 0)) as b:
                kv, dk = (
                    _key_block(builder, at, k0v, b.index),
                    _key_scale(builder, at, k0v, b.index, avx2 and HAVE_F16C),
                )
                qo = builder.add(q0v, builder.mul(b.index, _c32(b.index)))
                lanes = builder.sitofp(
                    _quad_sums(builder, kv, builder.load(at("q", qo, _V32I8), align=1), avx2), _V8F
                )
                dq = builder.load(at("d", builder.add(d0v, b.index), _F32))
                d = _splat(builder, builder.fmul(dk, dq), _V8F)
                builder.store(_call(builder, "llvm.fma.v8f32", _V8F, [d, lanes, builder.load(acc)]), acc)
            return _hsum8(builder, builder.load(acc))

        return types.float32(keys, types.intp, kd, qq, types.intp, qd, types.intp), codegen

    return q8_dot_row


def _c32(v: ir.Value) -> ir.Constant:
    return ir.Constant(v.type, 32)


q8_dot_row = _row_dot(HAVE_AVX2)
q8_dot_row_portable = _row_dot(False)  # the same sums in plain IR (tests compare the two)


@intrinsic
def scale_i8x32(typingctx, a, ia, d, out, io):
    """out[io + e] = d * float(a[ia + e]) for e < 32 (flat indices; a int8, out float32, both
    C-contiguous), unchecked: a q8_0 block dequantized as ggml's dequantize_row_q8_0."""
    if not (_c_arrays(types.int8, a) and _c_arrays(types.float32, out)):
        return None

    def codegen(context, builder, signature, args):
        x = builder.sitofp(builder.load(_at(context, builder, a, args[0], args[1], _V32I8), align=1), _V32F)
        y = builder.fmul(_splat(builder, args[2], _V32F), x)
        builder.store(y, _at(context, builder, out, args[3], args[4], _V32F), align=4)
        return context.get_dummy_value()

    return types.void(a, types.intp, types.float32, out, types.intp), codegen
