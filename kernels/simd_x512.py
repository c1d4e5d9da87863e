"""AVX-512 block kernels in LLVM IR (used through Numba intrinsics), twins of simd_x86's AVX2 ones.

512-bit registers halve the instruction count per weight byte, and AVX512-VNNI fuses the multiply
and the int32 accumulation (`vpdpwssd`: int16 pairs, `vpdpbusd`: uint8 x int8 quads) that AVX2
needs two or three instructions for.  Selected at run time: `HAVE_AVX512` (F, BW, VL) and
`HAVE_VNNI` (AVX512-VNNI) come from the host CPU's features; every kernel here gives the same
integer sums as its AVX2 and portable twins (tests compare them bit for bit).
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .packing import TILE_ROWS
from .simd_x86 import (
    HAVE_AVX2,
    HAVE_VNNI256,
    PREFETCH_AHEAD,
    _call,
    _const,
    _prefetch,
    crumb_pairs,
    split_pairs,
    widened_pair_sums,
)


def _host_features() -> dict:
    try:
        return dict(llvm.get_host_cpu_features())
    except Exception:  # unknown host: use the AVX2 or portable kernels
        return {}


_FEATURES = _host_features()
HAVE_AVX512 = HAVE_AVX2 and all(_FEATURES.get(f, False) for f in ("avx512f", "avx512bw", "avx512vl"))
HAVE_VNNI = HAVE_AVX512 and bool(_FEATURES.get("avx512vnni", False))
# The AVX2 kernel family (no AVX-512), and within it AVX-VNNI's (the 256-bit `vpdpbusd` forms):
# the one spelling matmul_int and matmul_row dispatch on.
AVX2_ONLY = HAVE_AVX2 and not HAVE_AVX512
AVX2_VNNI = AVX2_ONLY and HAVE_VNNI256

_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16I32, _V32I16, _V32I8, _V8I64 = (
    ir.VectorType(_i32, 16),
    ir.VectorType(_i16, 32),
    ir.VectorType(_i8, 32),
    ir.VectorType(_i64, 8),
)
_SIG = types.void(types.int64, types.int64, types.int64, types.int64)
_V64I8 = ir.VectorType(_i8, 64)


def _load(builder: ir.IRBuilder, base: ir.Value, offset: int, ty: ir.Type) -> ir.Value:
    ptr = builder.gep(base, [_const(_i32, offset)])
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _store(builder: ir.IRBuilder, value: ir.Value, base: ir.Value, offset: int) -> None:
    ptr = builder.gep(base, [_const(_i32, offset)])
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


def _dot16(builder: ir.IRBuilder, acc: ir.Value | None, w: ir.Value, x: ir.Value, vnni: bool) -> ir.Value:
    """acc + per int32 lane, w[2i] * x[2i] + w[2i+1] * x[2i+1] (int16 pairs)."""
    if acc is None:
        acc = ir.Constant(_V16I32, [0] * 16)
    wi, xi = builder.bitcast(w, _V16I32), builder.bitcast(x, _V16I32)
    if vnni:
        return _call(builder, "llvm.x86.avx512.vpdpwssd.512", _V16I32, [acc, wi, xi])
    p = _call(builder, "llvm.x86.avx512.pmaddw.d.512", _V16I32, [w, x])
    return builder.add(acc, p)


def _pair_rows(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """Lanes (2i, 2i+1) of a then b are the two halves of 16 rows' sums: add them, rows in order."""
    even = builder.shuffle_vector(a, b, _const(ir.VectorType(_i32, 16), list(range(0, 32, 2))))
    odd = builder.shuffle_vector(a, b, _const(ir.VectorType(_i32, 16), list(range(1, 32, 2))))
    return builder.add(even, odd)


def _q8_sums16(builder: ir.IRBuilder, args: list[ir.Value], vnni: bool) -> None:
    qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
    sp = builder.inttoptr(args[2], _i8.as_pointer())
    acc: list = [None] * (TILE_ROWS // 8)
    for g in range(8):
        quad = _load(builder, xp, 8 * g, _i64)  # x16[4g .. 4g+3]
        xv = builder.insert_element(ir.Constant(_V8I64, ir.Undefined), quad, _const(_i32, 0))
        xv = builder.bitcast(builder.shuffle_vector(xv, xv, _const(ir.VectorType(_i32, 8), [0] * 8)), _V32I16)
        for rv in range(TILE_ROWS // 8):  # 8 rows x 4 int8, widened to int16
            if rv % 2 == 0:  # one line ahead per 64 bytes: the projection then reads as fast as a plain read
                _prefetch(builder, qp, PREFETCH_AHEAD + (g * TILE_ROWS + rv * 8) * 4)
            w = builder.sext(_load(builder, qp, (g * TILE_ROWS + rv * 8) * 4, _V32I8), _V32I16)
            acc[rv] = _dot16(builder, acc[rv], w, xv, vnni)
    for m in range(TILE_ROWS // 16):
        _store(builder, _pair_rows(builder, acc[2 * m], acc[2 * m + 1]), sp, m * 64)


@intrinsic
def q8_block_sums16_vnni(typingctx, q_addr, x_addr, s_addr, unused):
    """simd_x86.q8_block_sums16_avx2 with AVX512-VNNI: one Q8_0 32-block of a 64-row tile (quad
    layout) times 32 int16 activations, s[r] = sum_e q[r, e] * x[e] (int32)."""

    def codegen(context, builder, signature, args):
        _q8_sums16(builder, args, True)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def q8_block_sums16_avx512(typingctx, q_addr, x_addr, s_addr, unused):
    """q8_block_sums16_vnni for AVX-512 CPUs without VNNI (`vpmaddwd` + `vpaddd`)."""

    def codegen(context, builder, signature, args):
        _q8_sums16(builder, args, False)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- Q8_0 weights x int8 activations: `vpdpbusd` multiplies unsigned by signed bytes, so the weights
# are biased to w + 128 (one xor) and 128 * sum(x) of the block comes off once at the start.
@intrinsic
def q8_block_sums_vnni(typingctx, q_addr, x_addr, s_addr, unused):
    """simd_x86.q8_block_sums_avx2 with AVX512-VNNI: one Q8_0 32-block of a 64-row tile (quad
    layout) times 32 int8 activations, s[r] = sum_e q[r, e] * x[e] (int32)."""

    def codegen(context, builder, signature, args):
        qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        sp = builder.inttoptr(args[2], _i8.as_pointer())
        xs = builder.sext(_load(builder, xp, 0, _V32I8), ir.VectorType(_i32, 32))
        total = _call(builder, "llvm.vector.reduce.add.v32i32", _i32, [xs])
        bias = builder.mul(total, _const(_i32, -128))
        v = builder.insert_element(ir.Constant(_V16I32, ir.Undefined), bias, _const(_i32, 0))
        start = builder.shuffle_vector(v, v, _const(_V16I32, [0] * 16))
        acc = [start] * (TILE_ROWS // 16)
        flip = _const(_V64I8, [-128] * 64)
        for g in range(8):
            quad = builder.insert_element(
                ir.Constant(_V16I32, ir.Undefined), _load(builder, xp, 4 * g, _i32), _const(_i32, 0)
            )
            xq = builder.shuffle_vector(quad, quad, _const(_V16I32, [0] * 16))
            for m in range(TILE_ROWS // 16):
                _prefetch(builder, qp, PREFETCH_AHEAD + (g * TILE_ROWS + m * 16) * 4)
                w = builder.xor(_load(builder, qp, (g * TILE_ROWS + m * 16) * 4, _V64I8), flip)
                args3 = [acc[m], builder.bitcast(w, _V16I32), xq]
                acc[m] = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, args3)
        for m in range(TILE_ROWS // 16):
            _store(builder, acc[m], sp, m * 64)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- Q5's fifth bits: per row, the sum of x over the elements whose bit is set ---------------------
# A row's 16-bit word of fifth bits is cut into 5-bit groups; each group indexes a 32-entry table of
# the sums of x over its subsets, and `vpermw` looks up 32 rows at once (it reads an index's low 5
# bits, so a group needs only a shift).  The tables depend on the activations only: built once per
# block and call, they replace 32 shift / mask / multiply / add steps per row with 4 lookups.
BIT_TABLES = 8  # per 32-block: 2 words x 4 groups (bits 0-4, 5-9, 10-14, 15)
_V32I16T = ir.VectorType(_i32, 32)


def _group_elements(w: int, g: int) -> list[int]:
    return [16 * w + 5 * g + k for k in range(5) if 5 * g + k < 16]


@intrinsic
def q5_bit_tables_avx512(typingctx, x_addr, t_addr):
    """One 32-block of int8 x -> BIT_TABLES tables of 32 int16: table (w, g) entry v = sum over
    bits k of v of x[16w + 5g + k] (bits beyond the word's 16 count nothing)."""

    def codegen(context, builder, signature, args):
        xp, tp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        for w in range(2):
            for g in range(4):
                table = ir.Constant(_V32I16, [0] * 32)
                for k, e in enumerate(_group_elements(w, g)):
                    xe = builder.sext(builder.load(builder.gep(xp, [_const(_i32, e)])), _i16)
                    xv = builder.insert_element(ir.Constant(_V32I16, ir.Undefined), xe, _const(_i32, 0))
                    xv = builder.shuffle_vector(xv, xv, _const(_V32I16T, [0] * 32))
                    mask = _const(_V32I16, [-1 if (v >> k) & 1 else 0 for v in range(32)])
                    table = builder.add(table, builder.and_(xv, mask))
                _store(builder, table, tp, (w * 4 + g) * 64)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def q5_high_sums_avx512(typingctx, qh_addr, t_addr, s_addr, unused):
    """One 32-block of a 64-row tile: s[r] = sum of x over the elements whose fifth bit is set
    (int16), from qh (2 x 64 uint16: bit j of word w is element 16w + j) and the block's
    q5_bit_tables_avx512."""

    def codegen(context, builder, signature, args):
        qp, tp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        sp = builder.inttoptr(args[2], _i8.as_pointer())
        for h in range(TILE_ROWS // 32):
            acc = None
            for w in range(2):
                word = _load(builder, qp, (w * TILE_ROWS + 32 * h) * 2, _V32I16)
                for g in range(4):
                    idx = builder.lshr(word, _const(_V32I16, [5 * g] * 32)) if g else word
                    table = _load(builder, tp, (w * 4 + g) * 64, _V32I16)
                    part = _call(builder, "llvm.x86.avx512.permvar.hi.512", _V32I16, [table, idx])
                    acc = part if acc is None else builder.add(acc, part)
            _store(builder, acc, sp, 32 * h * 2)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- 4-bit nibbles x int8 activations (simd_x86.q4_block_sums_avx2 on 64 rows per register) -------
# vpunpcklbw / vpunpckhbw interleave within each 128-bit lane: lane L pairs rows 16L..16L+7 (lo)
# or 16L+8..16L+15 (hi) of the 64-row tile.
_UNPACK64 = {
    part: [
        i for lane in range(4) for b in range(8) for i in (16 * lane + first + b, 64 + 16 * lane + first + b)
    ]
    for part, first in (("lo", 0), ("hi", 8))
}
# lo/hi int16 results back to row order: rows 0-31 from lanes 0-1, rows 32-63 from lanes 2-3
_ROW_ORDER = [
    [src + 8 * lane + i for lane in (2 * q, 2 * q + 1) for src in (0, 32) for i in range(8)] for q in range(2)
]


def _pair16(builder: ir.IRBuilder, xp: ir.Value, j: int) -> ir.Value:
    """Pair j of an interleaved block (x[j], x[16 + j]), over 64 bytes."""
    pair = _load(builder, xp, 2 * j, _i16)
    v = builder.insert_element(ir.Constant(_V32I16, ir.Undefined), pair, _const(_i32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, _const(_V32I16T, [0] * 32)), _V64I8)


def _nibble_pairs(builder: ir.IRBuilder, qp: ir.Value, j: int) -> dict:
    """Byte j of the block's 64 rows as (lo, hi) nibble pairs, rows in _UNPACK64's lane order."""
    mask = _const(_V64I8, [15] * 64)
    v = _load(builder, qp, j * TILE_ROWS, _V64I8)
    low, high = builder.and_(v, mask), builder.and_(builder.lshr(v, _const(_V64I8, [4] * 64)), mask)
    order = ir.VectorType(_i32, 64)
    return {part: builder.shuffle_vector(low, high, _const(order, _UNPACK64[part])) for part in ("lo", "hi")}


def _nibble_sums(builder: ir.IRBuilder, args: list[ir.Value], pairs_of) -> None:
    """s0 (pairs j < 8) and s1 (j >= 8) of pairs_of(j)'s products with x's interleaved pairs."""
    xp = builder.inttoptr(args[1], _i8.as_pointer())
    outs = [builder.inttoptr(a, _i8.as_pointer()) for a in args[2:4]]
    acc: dict = {}
    for j in range(16):
        xv = _pair16(builder, xp, j)
        for part, pairs in pairs_of(j).items():
            p = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _V32I16, [pairs, xv])
            key = (j // 8, part)
            acc[key] = builder.add(acc[key], p) if key in acc else p
    for which in range(2):
        for q in range(2):
            rows = builder.shuffle_vector(
                acc[(which, "lo")], acc[(which, "hi")], _const(_V32I16T, _ROW_ORDER[q])
            )
            _store(builder, rows, outs[which], q * 64)


@intrinsic
def q4_block_sums_avx512(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """simd_x86.q4_block_sums_avx2 (the same int16 sums s0 over j < 8 and s1 over 8 <= j < 16 of
    lo(q[j, r]) * x[j] + hi(q[j, r]) * x[16 + j]) with 512-bit registers."""

    def codegen(context, builder, signature, args):
        qp = builder.inttoptr(args[0], _i8.as_pointer())

        def pairs_of(j):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * TILE_ROWS)
            return _nibble_pairs(builder, qp, j)

        _nibble_sums(builder, args, pairs_of)
        return context.get_dummy_value()

    return _SIG, codegen


# Many activation rows: a block's pairs unpacked once into PAIRS_BYTES of scratch (as simd_x86's
# AVX2 twins), then 32 `vpmaddubsw` + adds per row on 512-bit registers.
@intrinsic
def q4_unpack_pairs_avx512(typingctx, q_addr, p_addr):
    """One 32-block of a 64-row tile -> (lo, hi) nibble pairs in q4_pair_sums_avx512's order."""

    def codegen(context, builder, signature, args):
        qp, pp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        for j in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * TILE_ROWS)
            for i, pairs in enumerate(_nibble_pairs(builder, qp, j).values()):
                _store(builder, pairs, pp, (2 * j + i) * 64)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def q4_pair_sums_avx512(typingctx, p_addr, x_addr, s0_addr, s1_addr):
    """q4_block_sums_avx512 from q4_unpack_pairs_avx512's pairs: the same int16 sums."""

    def codegen(context, builder, signature, args):
        pp = builder.inttoptr(args[0], _i8.as_pointer())

        def pairs_of(j):
            return {part: _load(builder, pp, (2 * j + i) * 64, _V64I8) for i, part in enumerate(("lo", "hi"))}

        _nibble_sums(builder, args, pairs_of)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- Q6_K: nibble halves and 2-bit high parts, 32 rows per register (simd_x86.widened_pair_sums) ---
@intrinsic
def q4_block_sums_split_avx512(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """simd_x86.q4_block_sums_split_avx2 (s0: low nibbles' sums, s1: high ones', plain-order x)
    with 512-bit registers."""

    def codegen(context, builder, signature, args):
        widened_pair_sums(builder, args, 32, split_pairs, 16)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def crumb_sums_avx512(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """simd_x86.crumb_sums_avx2 (Q6_K's crumb sums) with 512-bit registers."""

    def codegen(context, builder, signature, args):
        widened_pair_sums(builder, args, 32, crumb_pairs, 8)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- Many activation rows with AVX512-VNNI: a block's quants unpacked once into "quads" ----------
# (4 consecutive elements of one row in one int32 lane, as unsigned bytes: 4-bit nibbles, plus the
# fifth bit (Q5) or the two high bits (Q6_K)), then per activation row one `vpdpbusd` per 16 rows x 4
# elements sums straight into int32 lanes in row order: no int16 partials, no reordering stores.
# Scratch: QUADS_BYTES, group G (elements 4G..4G+3, G < 8) of rows 16m.. at (4G + m) * 64.
QUADS_BYTES = 8 * 4 * 64
_V16I32T = ir.VectorType(_i32, 16)
_V64I32T = ir.VectorType(_i32, 64)


def _interleave(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, width: int, high: bool) -> ir.Value:
    """vpunpck{l,h}{bw,wd} on 64 bytes: a's and b's `width`-byte elements interleaved within each
    128-bit lane (the low or high half of each lane)."""
    n = 16 // width  # elements per lane
    half = n // 2 if high else 0
    idx = [
        (src * 64 // width) + lane * n + half + i
        for lane in range(4)
        for i in range(n // 2)
        for src in (0, 1)
    ]
    ty = ir.VectorType(ir.IntType(8 * width), 64 // width)
    mask = _const(ir.VectorType(_i32, len(idx)), idx)
    return builder.bitcast(
        builder.shuffle_vector(builder.bitcast(a, ty), builder.bitcast(b, ty), mask), _V64I8
    )


def _lanes(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, picks: list[tuple[int, int]]) -> ir.Value:
    """A vector of four 128-bit lanes, lane i = lane picks[i][1] of (a, b)[picks[i][0]]."""
    ty = ir.VectorType(_i64, 8)
    idx = [src * 8 + 2 * lane + e for src, lane in picks for e in range(2)]
    mask = _const(ir.VectorType(_i32, 8), idx)
    return builder.bitcast(
        builder.shuffle_vector(builder.bitcast(a, ty), builder.bitcast(b, ty), mask), _V64I8
    )


def _row_quads(builder: ir.IRBuilder, qp: ir.Value, first: int) -> list[ir.Value]:
    """Bytes first..first+3 of a 64-row tile block (byte j of row r at j * 64 + r) as four vectors
    of int32 lanes, vector m = rows 16m..16m+15 in order, lane = the row's 4 bytes."""
    return _lanes_to_rows(builder, _quads_in_lanes(builder, qp, first))


def _bytes_and(builder: ir.IRBuilder, v: ir.Value, shift: int, mask: int) -> ir.Value:
    """(v >> shift) & mask per byte (shifted as int32 lanes; the mask drops the bits that crossed)."""
    w = builder.bitcast(v, _V16I32T)
    if shift:
        w = builder.lshr(w, _const(_V16I32T, [shift] * 16))
    return builder.and_(builder.bitcast(w, _V64I8), _const(_V64I8, [mask] * 64))


def _quads_in_lanes(builder: ir.IRBuilder, qp: ir.Value, first: int) -> list[ir.Value]:
    """_row_quads without its lane moves: vector k, lane L = rows 16L + 4k .. 16L + 4k + 3."""
    v = [_load(builder, qp, (first + i) * TILE_ROWS, _V64I8) for i in range(4)]
    lo01, hi01 = _interleave(builder, v[0], v[1], 1, False), _interleave(builder, v[0], v[1], 1, True)
    lo23, hi23 = _interleave(builder, v[2], v[3], 1, False), _interleave(builder, v[2], v[3], 1, True)
    halves = ((lo01, lo23), (hi01, hi23))
    return [_interleave(builder, a, b, 2, high) for a, b in halves for high in (False, True)]


def _lanes_to_rows(builder: ir.IRBuilder, acc: list[ir.Value]) -> list[ir.Value]:
    """_quads_in_lanes' order back to rows: vector m = lane m of acc[0..3] (rows 16m..16m+15)."""
    a = [builder.bitcast(v, _V64I8) for v in acc]
    p = _lanes(builder, a[0], a[1], [(0, 0), (0, 1), (1, 0), (1, 1)])
    q = _lanes(builder, a[2], a[3], [(0, 0), (0, 1), (1, 0), (1, 1)])
    r = _lanes(builder, a[0], a[1], [(0, 2), (0, 3), (1, 2), (1, 3)])
    s = _lanes(builder, a[2], a[3], [(0, 2), (0, 3), (1, 2), (1, 3)])
    pairs = ((p, q, 0), (p, q, 1), (r, s, 0), (r, s, 1))
    return [_lanes(builder, x, y, [(0, i), (0, i + 2), (1, i), (1, i + 2)]) for x, y, i in pairs]


def _broadcast32(builder: ir.IRBuilder, xp: ir.Value, offset: int) -> ir.Value:
    value = _load(builder, xp, offset, _i32)
    quad = builder.insert_element(ir.Constant(_V16I32, ir.Undefined), value, _const(_i32, 0))
    return builder.shuffle_vector(quad, quad, _const(_V16I32, [0] * 16))


# One activation row with VNNI: four bytes of each row moved into one int32 lane by in-lane unpacks,
# then one `vpdpbusd` per 16 rows x 4 elements for the low nibbles and one for the high ones kept
# in place (16 x the nibble: no shift; the sums are divided by 16 at the end, exactly).  Fewer
# instructions than q4_block_sums_avx512's shuffles + `vpmaddubsw` + int16 adds, and a weight stream
# from memory ran ~1.7x faster through it (docs/benchmarks.md, Design measurements).
@intrinsic
def q4_block_sums_vnni(typingctx, q_addr, x_addr, s_addr, unused):
    """q4_block_sums_avx512's totals as int32, s[r] = sum_j lo(q[j, r]) * x[j] + hi(q[j, r]) * x[16 + j],
    rows in order, from the plain (not interleaved) activation block x."""

    def codegen(context, builder, signature, args):
        qp, xp, sp = (builder.inttoptr(a, _i8.as_pointer()) for a in args[:3])
        low, high = [ir.Constant(_V16I32, [0] * 16)] * 4, [ir.Constant(_V16I32, [0] * 16)] * 4
        dot = "llvm.x86.avx512.vpdpbusd.512"
        for g in range(4):
            for i in range(4):
                _prefetch(builder, qp, PREFETCH_AHEAD + (4 * g + i) * TILE_ROWS)
            x_lo, x_hi = _broadcast32(builder, xp, 4 * g), _broadcast32(builder, xp, 16 + 4 * g)
            for k, quad in enumerate(_quads_in_lanes(builder, qp, 4 * g)):
                lo, hi16 = (builder.bitcast(_bytes_and(builder, quad, 0, m), _V16I32) for m in (15, 0xF0))
                low[k] = _call(builder, dot, _V16I32, [low[k], lo, x_lo])
                high[k] = _call(builder, dot, _V16I32, [high[k], hi16, x_hi])
        four = _const(_V16I32, [4] * 16)
        sums = [builder.add(a, builder.ashr(b, four)) for a, b in zip(low, high, strict=True)]
        for m, rows in enumerate(_lanes_to_rows(builder, sums)):
            _store(builder, rows, sp, m * 64)
        return context.get_dummy_value()

    return _SIG, codegen


def _fifth_bits(builder: ir.IRBuilder, hp: ir.Value, word: int, m: int, g: int) -> ir.Value:
    """Q5: bits 4g..4g+3 of word `word` of rows 16m.. as bytes 0 or 16 of each row's int32 lane."""
    w = builder.zext(_load(builder, hp, (word * TILE_ROWS + 16 * m) * 2, ir.VectorType(_i16, 16)), _V16I32T)
    t = builder.and_(builder.lshr(w, _const(_V16I32T, [4 * g] * 16)), _const(_V16I32T, [15] * 16))
    spread = builder.and_(
        builder.mul(t, _const(_V16I32T, [0x204081] * 16)), _const(_V16I32T, [0x01010101] * 16)
    )
    return builder.bitcast(builder.shl(spread, _const(_V16I32T, [4] * 16)), _V64I8)


def _unpack_quads(builder: ir.IRBuilder, qp: ir.Value, hp: ir.Value | None, pp: ir.Value, high: str) -> None:
    """One 32-block of a 64-row tile -> QUADS_BYTES of unsigned quads; high: "" (4-bit), "q5" (hp:
    2 x 64 uint16 fifth-bit words) or "q6" (hp: Q6_K's 8 x 64 crumb bytes)."""
    # Q6_K's quads (decode of 3+ rows) follow the CPU's prefetch rule (without it on Zen 4 four rows
    # streamed 10-15% faster); the 4- and 5-bit ones keep the prefetch measured for their prefill.
    for line in range(16):
        _prefetch(builder, qp, PREFETCH_AHEAD + line * TILE_ROWS, every_cpu=high != "q6")
    if high == "q6":  # the crumbs are a third of Q6_K's bytes: without this, decode stalled on them
        for line in range(8):
            _prefetch(builder, hp, PREFETCH_AHEAD // 2 + line * TILE_ROWS)
    crumbs = [_row_quads(builder, hp, 4 * c) for c in range(2)] if high == "q6" else None
    for g in range(4):
        quads = _row_quads(builder, qp, 4 * g)
        for m in range(4):
            lo, hi = _bytes_and(builder, quads[m], 0, 15), _bytes_and(builder, quads[m], 4, 15)
            if high == "q5":
                lo = builder.or_(lo, _fifth_bits(builder, hp, 0, m, g))
                hi = builder.or_(hi, _fifth_bits(builder, hp, 1, m, g))
            elif high == "q6":
                c = crumbs[g % 2][m]  # element e's crumb: byte e % 8, bits 2 * (e // 8)
                lo = builder.or_(
                    lo, builder.shl(_bytes_and(builder, c, 2 * (g // 2), 3), _const(_V64I8, [4] * 64))
                )
                hi = builder.or_(
                    hi, builder.shl(_bytes_and(builder, c, 4 + 2 * (g // 2), 3), _const(_V64I8, [4] * 64))
                )
            _store(builder, lo, pp, (4 * g + m) * 64)
            _store(builder, hi, pp, (4 * (g + 4) + m) * 64)


def _quads_intrinsic(high: str):
    def codegen(context, builder, signature, args):
        qp, hp, pp = (builder.inttoptr(a, _i8.as_pointer()) for a in args[:3])
        _unpack_quads(builder, qp, hp if high else None, pp, high)
        return context.get_dummy_value()

    return codegen


@intrinsic
def q4_unpack_quads_vnni(typingctx, q_addr, h_addr, p_addr):
    """One 32-block of a 64-row nibble tile (16 x 64 bytes, h unused) -> QUADS_BYTES of quads."""
    return types.void(types.int64, types.int64, types.int64), _quads_intrinsic("")


@intrinsic
def q5_unpack_quads_vnni(typingctx, q_addr, h_addr, p_addr):
    """q4_unpack_quads_vnni plus the fifth bits (h: the block's 2 x 64 uint16 words): values 0..31."""
    return types.void(types.int64, types.int64, types.int64), _quads_intrinsic("q5")


@intrinsic
def q6_unpack_quads_vnni(typingctx, q_addr, h_addr, p_addr):
    """Q6_K: nibbles plus 16 x crumb (h: the block's 8 x 64 crumb bytes): values 0..63."""
    return types.void(types.int64, types.int64, types.int64), _quads_intrinsic("q6")


def _quad_sums(builder: ir.IRBuilder, args: list[ir.Value], split: bool) -> None:
    pp, xp, sp = (builder.inttoptr(a, _i8.as_pointer()) for a in args[:3])
    # two accumulators per 16 rows (elements 0..15, 16..31): 8 independent vpdpbusd chains
    acc: list = [[ir.Constant(_V16I32T, [0] * 16)] * 4 for _ in range(2)]
    for g in range(8):
        quad = _load(builder, xp, 4 * g, _i32)
        v = builder.insert_element(ir.Constant(_V16I32T, ir.Undefined), quad, _const(_i32, 0))
        xq = builder.shuffle_vector(v, v, _const(_V16I32T, [0] * 16))
        for m in range(4):
            w = builder.bitcast(_load(builder, pp, (4 * g + m) * 64, _V64I8), _V16I32T)
            acc[g // 4][m] = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32T, [acc[g // 4][m], w, xq])
    for m in range(4):
        if split:
            _store(builder, acc[0][m], sp, m * 64)
            _store(builder, acc[1][m], sp, (TILE_ROWS + 16 * m) * 4)
        else:
            _store(builder, builder.add(acc[0][m], acc[1][m]), sp, m * 64)


@intrinsic
def quad_sums_vnni(typingctx, p_addr, x_addr, s_addr):
    """One activation row (plain-order int8 x) times a block unpacked by q*_unpack_quads_vnni:
    s[r] = sum over the 32 elements of q * x (int32, 64 rows)."""

    def codegen(context, builder, signature, args):
        _quad_sums(builder, args, False)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def quad_sums_split_vnni(typingctx, p_addr, x_addr, s_addr):
    """quad_sums_vnni with the halves apart (Q6_K's two scales): s[r] sums elements 0..15 and
    s[64 + r] elements 16..31."""

    def codegen(context, builder, signature, args):
        _quad_sums(builder, args, True)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


# Q6_K from one or two activation rows with VNNI: each row's six-bit values (nibble | crumb << 4) are
# assembled in int32 lanes in registers (q4_block_sums_vnni's in-lane order) and summed by one
# `vpdpbusd` per 16 rows x 4 elements and activation row: no unpacked quads stored and read back, and
# the two halves' sums (Q6_K's two scales) kept apart.  The output projection's precise form passes
# two rows (x and its rounding residual), the same assembled values serving both.
def _crumb_at4(builder: ir.IRBuilder, c: ir.Value, bit: int) -> ir.Value:
    """Bits bit, bit+1 of each byte of c moved to bits 4, 5 (the rest zero)."""
    w = builder.bitcast(c, _V16I32T)
    if bit < 4:
        w = builder.shl(w, _const(_V16I32T, [4 - bit] * 16))
    elif bit > 4:
        w = builder.lshr(w, _const(_V16I32T, [bit - 4] * 16))
    return builder.and_(builder.bitcast(w, _V64I8), _const(_V64I8, [0x30] * 64))


def _q6_block_sums(builder: ir.IRBuilder, qp: ir.Value, hp: ir.Value, xps: list, sps: list) -> None:
    for line in range(16):
        _prefetch(builder, qp, PREFETCH_AHEAD + line * TILE_ROWS)
    for line in range(8):
        _prefetch(builder, hp, PREFETCH_AHEAD // 2 + line * TILE_ROWS)
    zero = ir.Constant(_V16I32T, [0] * 16)
    acc = [[[zero] * 4 for _ in range(2)] for _ in xps]  # [row][half][k]
    crumbs = [_quads_in_lanes(builder, hp, 4 * c) for c in range(2)]
    for g in range(4):
        xq = [[_broadcast32(builder, xp, 16 * half + 4 * g) for half in range(2)] for xp in xps]
        for k, quad in enumerate(_quads_in_lanes(builder, qp, 4 * g)):
            c, bit = crumbs[g % 2][k], 2 * (g // 2)  # element e's crumb: byte e % 8, bits 2 * (e // 8)
            six = [
                builder.bitcast(
                    builder.or_(_bytes_and(builder, quad, 4 * h, 15), _crumb_at4(builder, c, bit + 4 * h)),
                    _V16I32T,
                )
                for h in range(2)
            ]
            for t in range(len(xps)):
                for h in range(2):
                    acc[t][h][k] = _call(
                        builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32T, [acc[t][h][k], six[h], xq[t][h]]
                    )
    for t, sp in enumerate(sps):
        for h in range(2):
            for m, rows in enumerate(_lanes_to_rows(builder, acc[t][h])):
                _store(builder, rows, sp, (h * TILE_ROWS + 16 * m) * 4)


@intrinsic
def q6_block_sums_vnni(typingctx, q_addr, h_addr, x_addr, s_addr):
    """One Q6_K 32-block of a 64-row tile (q: 16 x 64 nibble bytes, h: 8 x 64 crumb bytes) times one
    plain-order int8 activation block x: s[r] (int32) sums elements 0..15 of row r's six-bit values
    (0..63, before the -32) times x, s[64 + r] elements 16..31."""

    def codegen(context, builder, signature, args):
        qp, hp, xp, sp = (builder.inttoptr(a, _i8.as_pointer()) for a in args)
        _q6_block_sums(builder, qp, hp, [xp], [sp])
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def q6_block_sums2_vnni(typingctx, q_addr, h_addr, x_addr, x2_addr, s_addr):
    """q6_block_sums_vnni for two activation blocks: x's sums at s, x2's at s + 512 bytes."""

    def codegen(context, builder, signature, args):
        qp, hp, xp, x2p, sp = (builder.inttoptr(a, _i8.as_pointer()) for a in args)
        sp2 = builder.gep(sp, [_const(_i32, 2 * TILE_ROWS * 4)])
        _q6_block_sums(builder, qp, hp, [xp, x2p], [sp, sp2])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64, types.int64), codegen
