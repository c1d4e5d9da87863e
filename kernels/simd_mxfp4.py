"""AVX2 block kernels for MXFP4 weights, in LLVM IR (used through Numba intrinsics), like simd_x86's.

An MXFP4 element is a 4-bit code for a signed E2M1 value; doubled, the 16 values are the int8s of
quant.ggml.MXFP4_VALUES (-12..12).  `vpshufb` looks 32 codes up at once.  `vpmaddubsw` multiplies
unsigned by signed bytes, so each product is formed as |w| * (sign(w) x) (`vpabsb`, `vpsignb`), as ggml
does; a pair's sum is at most 2 * 12 * 127 and eight pairs' at most 24384, within int16.

Layout (packing.py): for one 32-block of a 64-row tile, byte j of each row lies at q[j * 64 + r]; its
low nibble is the code of element j, its high nibble that of element j + 16 (Q4_0's order).

With AVX512-VNNI the kernels below take their place: simd_x512's Q4 quads (four elements of a row in an
int32 lane), each code looked up as its doubled value plus 12 (0..24: `vpdpbusd` multiplies unsigned by
signed bytes), one `vpdpbusd` per 16 rows x 4 elements, in registers for one activation row or unpacked
once into simd_x512's quads scratch for more; the caller takes 12 times the block's activation sum back
off, so the integers are the AVX2 kernels' exactly.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..quant.ggml import MXFP4_VALUES
from .simd_x86 import (
    _SIG,
    _UNPACK,
    _V16I16,
    _V32I8,
    PREFETCH_AHEAD,
    _accumulate,
    _call,
    _const,
    _i32,
    _ipair_broadcast,
    _nibbles,
    _pairs_slot,
    _pointers,
    _prefetch,
    _store_all,
    pair_sums_codegen,
)
from .simd_x512 import (
    _V16I32,
    _V64I8,
    _broadcast32,
    _bytes_and,
    _lanes_to_rows,
    _quads_in_lanes,
    _row_quads,
    _store,
)

_TABLE = [int(v) for v in MXFP4_VALUES] * 2  # vpshufb looks up within each 128-bit half
VNNI_OFFSET = 12  # added to every doubled value for vpdpbusd's unsigned operand (-12..12 -> 0..24)
_TABLE_VNNI = [int(v) + VNNI_OFFSET for v in MXFP4_VALUES] * 4


def _lookup(builder: ir.IRBuilder, codes: ir.Value) -> ir.Value:
    """32 codes (0..15) -> their doubled E2M1 values as int8."""
    return _call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, [_const(_V32I8, _TABLE), codes])


def _signed_pmadd(builder: ir.IRBuilder, w: ir.Value, xv: ir.Value) -> ir.Value:
    """Per int16 lane: w[2i] * x[2i] + w[2i+1] * x[2i+1] for signed w (|w| * sign(w) x)."""
    aw = _call(builder, "llvm.abs.v32i8", _V32I8, [w, ir.Constant(ir.IntType(1), 0)])
    sx = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, w])
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])


def _value_pairs(builder: ir.IRBuilder, qp: ir.Value, j: int, h: int) -> dict:
    """Byte j of the 32 rows of half h as (element j, element j + 16) value pairs, per _UNPACK part."""
    low, high = _nibbles(builder, qp, j, h)
    low, high = _lookup(builder, low), _lookup(builder, high)
    mask = {part: _const(ir.VectorType(_i32, 32), _UNPACK[part]) for part in ("lo", "hi")}
    return {part: builder.shuffle_vector(low, high, m) for part, m in mask.items()}


@intrinsic
def mxfp4_block_sums_avx2(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """For one 32-block of a 64-row tile: s0[r] = sum over j < 8, s1[r] = over 8 <= j < 16, of
    v(lo(q[j, r])) * x[j] + v(hi(q[j, r])) * x[16 + j]  (int16), v the doubled E2M1 value.
    Addresses: q 16 x 64 uint8, x 32 int8 interleaved (quantize_act's x8p), s0/s1 64 int16."""

    def codegen(context, builder, signature, args):
        qp, xp, s0, s1 = _pointers(builder, args)
        acc: dict = {}
        for j in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * 64)
            xv = _ipair_broadcast(builder, xp, j)
            for h in range(2):
                pairs = _value_pairs(builder, qp, j, h)
                products = {part: _signed_pmadd(builder, w, xv) for part, w in pairs.items()}
                _accumulate(builder, acc, (j // 8, h), products)
        _store_all(builder, acc, s0, s1)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def mxfp4_unpack_pairs_avx2(typingctx, q_addr, p_addr):
    """One 32-block of a 64-row tile -> PAIRS_BYTES of value pairs in the order mxfp4_pair_sums_avx2
    reads them (simd_x86's pair slots), looked up once for every activation row."""

    def codegen(context, builder, signature, args):
        qp, pp = (
            builder.inttoptr(args[0], ir.IntType(8).as_pointer()),
            builder.inttoptr(args[1], ir.IntType(8).as_pointer()),
        )
        for j in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * 64)
            for h in range(2):
                for part, pairs in _value_pairs(builder, qp, j, h).items():
                    ptr = builder.gep(pp, [_const(_i32, _pairs_slot(j, h, part))])
                    builder.store(pairs, builder.bitcast(ptr, _V32I8.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def mxfp4_pair_sums_avx2(typingctx, p_addr, x_addr, s0_addr, s1_addr):
    """mxfp4_block_sums_avx2's sums from unpacked value pairs (mxfp4_unpack_pairs_avx2)."""
    return _SIG, pair_sums_codegen(_signed_pmadd)


def _lookup_vnni(builder: ir.IRBuilder, quad: ir.Value, shift: int) -> ir.Value:
    """The codes in bits shift..shift+3 of each byte of quad -> their doubled values plus 12."""
    codes = _bytes_and(builder, quad, shift, 15)
    return _call(builder, "llvm.x86.avx512.pshuf.b.512", _V64I8, [_const(_V64I8, _TABLE_VNNI), codes])


@intrinsic
def mxfp4_block_sums_vnni(typingctx, q_addr, x_addr, s_addr, unused):
    """For one 32-block of a 64-row tile and one activation row: s[r] (int32, rows in order) = sum over j
    < 16 of (v(lo(q[j, r])) + 12) * x[j] + (v(hi(q[j, r])) + 12) * x[16 + j], v the doubled E2M1 value;
    x the plain (not interleaved) int8 block.  s[r] - 12 * sum(x) is mxfp4_block_sums_avx2's s0 + s1."""

    def codegen(context, builder, signature, args):
        qp, xp, sp = (builder.inttoptr(a, ir.IntType(8).as_pointer()) for a in args[:3])
        acc = [ir.Constant(_V16I32, [0] * 16)] * 4
        for g in range(4):
            for i in range(4):
                _prefetch(builder, qp, PREFETCH_AHEAD + (4 * g + i) * 64)
            x_lo, x_hi = _broadcast32(builder, xp, 4 * g), _broadcast32(builder, xp, 16 + 4 * g)
            for k, quad in enumerate(_quads_in_lanes(builder, qp, 4 * g)):
                for shift, xv in ((0, x_lo), (4, x_hi)):
                    dot = [acc[k], builder.bitcast(_lookup_vnni(builder, quad, shift), _V16I32), xv]
                    acc[k] = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, dot)
        for m, rows in enumerate(_lanes_to_rows(builder, acc)):
            _store(builder, rows, sp, m * 64)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def mxfp4_unpack_quads_vnni(typingctx, q_addr, p_addr):
    """One 32-block of a 64-row tile -> simd_x512.QUADS_BYTES of quads of doubled values plus 12, in the
    order simd_x512.quad_sums_vnni reads (group G = elements 4G..4G+3 of rows 16m.. at (4G + m) * 64)."""

    def codegen(context, builder, signature, args):
        qp, pp = (builder.inttoptr(a, ir.IntType(8).as_pointer()) for a in args[:2])
        for line in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + line * 64, every_cpu=True)
        for g in range(4):
            for m, quad in enumerate(_row_quads(builder, qp, 4 * g)):
                _store(builder, _lookup_vnni(builder, quad, 0), pp, (4 * g + m) * 64)
                _store(builder, _lookup_vnni(builder, quad, 4), pp, (4 * (g + 4) + m) * 64)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen
