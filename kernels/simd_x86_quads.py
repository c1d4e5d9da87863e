"""AVX2 kernels for many activation rows: a weight block unpacked once into "quads", then per row
`vpmaddubsw` + `vpmaddwd` straight into int32 lanes in row order (AVX2 has no `vpdpbusd`).

The scratch layout is simd_x512's QUADS_BYTES one: group G (elements 4G..4G+3 of the block) of rows
8v..8v+7 at (8G + v) * 32, each row's four unsigned values (4-bit nibbles; plus the fifth bit (Q5)
or 16 x the two high bits (Q6_K)) in one int32 lane.  Per row and 8-row vector, each group's
`vpmaddubsw` gives int16 pair sums of at most 2 x 63 x 127 = 16002; groups are added in int16 as
far as no sum can pass 2**15 (8 groups of 4-bit values, 4 of 5-bit, 2 of 6-bit) and widened with
`vpmaddwd` by ones.  So Q5_0/Q5_1/Q5_K and Q6_K cost about what Q4 does, where the int16 nibble
kernels (simd_x86) need separate fifth-bit and crumb passes.  Only compiled where the host has AVX2.
With the 256-bit `vpdpbusd` (simd_x86.HAVE_VNNI256: AVX-VNNI) one instruction per 8 rows x 4 elements
replaces the pair, whatever the bit width (quad_sums_avxvnni).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .packing import TILE_ROWS
from .simd_x86 import PREFETCH_AHEAD, VPDPBUSD256, _call, _const, _prefetch

_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V32I8, _V16I16, _V8I32, _V4I64 = (
    ir.VectorType(_i8, 32),
    ir.VectorType(_i16, 16),
    ir.VectorType(_i32, 8),
    ir.VectorType(_i64, 4),
)
_V16I8 = ir.VectorType(_i8, 16)
VECS = TILE_ROWS // 8  # 8-row vectors per tile
# Group G's values of rows 8v.. sit at (G * VECS + v) * 32 bytes: simd_x512.QUADS_BYTES in all.
QUADS_BYTES_AVX2 = 8 * VECS * 32


def _ptr(builder: ir.IRBuilder, addr: ir.Value) -> ir.Value:
    return builder.inttoptr(addr, _i8.as_pointer())


def _load(builder: ir.IRBuilder, base: ir.Value, offset: int, ty: ir.Type) -> ir.Value:
    ptr = builder.gep(base, [_const(_i32, offset)])
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _store(builder: ir.IRBuilder, value: ir.Value, base: ir.Value, offset: int) -> None:
    ptr = builder.gep(base, [_const(_i32, offset)])
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


def _unpack(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, width: int, high: bool) -> ir.Value:
    """vpunpck{l,h}{bw,wd} on 256 bits: a's and b's `width`-byte elements interleaved within each
    128-bit lane (the low or high half of each lane)."""
    n = 16 // width  # elements per lane
    first = n // 2 if high else 0
    idx = [src * 2 * n + lane * n + first + i for lane in range(2) for i in range(n // 2) for src in (0, 1)]
    ty = ir.VectorType(ir.IntType(8 * width), 32 // width)
    mask = _const(ir.VectorType(_i32, len(idx)), idx)
    out = builder.shuffle_vector(builder.bitcast(a, ty), builder.bitcast(b, ty), mask)
    return builder.bitcast(out, _V32I8)


def _halves(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, lane: int) -> ir.Value:
    """vperm2i128: 128-bit lane `lane` of a, then the same lane of b."""
    mask = _const(ir.VectorType(_i32, 4), [2 * lane, 2 * lane + 1, 4 + 2 * lane, 5 + 2 * lane])
    out = builder.shuffle_vector(builder.bitcast(a, _V4I64), builder.bitcast(b, _V4I64), mask)
    return builder.bitcast(out, _V32I8)


def row_quads(builder: ir.IRBuilder, qp: ir.Value, first: int) -> list[ir.Value]:
    """Bytes first..first+3 of a 64-row tile block (byte j of row r at j * 64 + r) as VECS vectors,
    vector v = rows 8v..8v+7 in order, each row's four bytes in one int32 lane."""
    out: list = [None] * VECS
    for h in range(TILE_ROWS // 32):
        v = [_load(builder, qp, (first + i) * TILE_ROWS + 32 * h, _V32I8) for i in range(4)]
        ab_lo, ab_hi = _unpack(builder, v[0], v[1], 1, False), _unpack(builder, v[0], v[1], 1, True)
        cd_lo, cd_hi = _unpack(builder, v[2], v[3], 1, False), _unpack(builder, v[2], v[3], 1, True)
        # x[k]: lane 0 rows 4k..4k+3, lane 1 rows 16 + 4k.. (of this 32-row half)
        x = [
            _unpack(builder, ab_lo, cd_lo, 2, False),
            _unpack(builder, ab_lo, cd_lo, 2, True),
            _unpack(builder, ab_hi, cd_hi, 2, False),
            _unpack(builder, ab_hi, cd_hi, 2, True),
        ]
        for part in range(2):  # rows 0-15 (lanes 0) then 16-31 (lanes 1)
            out[4 * h + 2 * part] = _halves(builder, x[0], x[1], part)
            out[4 * h + 2 * part + 1] = _halves(builder, x[2], x[3], part)
    return out


def _bytes_and(builder: ir.IRBuilder, v: ir.Value, shift: int, mask: int) -> ir.Value:
    """(v shifted by `shift` bits, right if positive) & mask per byte, shifted as int32 lanes (the
    mask drops the bits that crossed bytes)."""
    w = builder.bitcast(v, _V8I32)
    if shift > 0:
        w = builder.lshr(w, _const(_V8I32, [shift] * 8))
    elif shift < 0:
        w = builder.shl(w, _const(_V8I32, [-shift] * 8))
    return builder.and_(builder.bitcast(w, _V32I8), _const(_V32I8, [mask] * 32))


def _fifth_bits(builder: ir.IRBuilder, hp: ir.Value, word: int, v: int, g: int) -> ir.Value:
    """Q5: bits 4g..4g+3 of fifth-bit word `word` of rows 8v..8v+7, as bytes 0 or 16 of each
    row's int32 lane: a byte shuffle brings each row's word byte to its four lanes, a compare per
    bit turns it into a mask."""
    words = _load(builder, hp, (word * TILE_ROWS + 8 * v) * 2, _V16I8)  # 8 rows' uint16
    idx = [2 * (4 * lane + i) + g // 2 for lane in range(2) for i in range(4) for _ in range(4)]
    spread = builder.shuffle_vector(words, words, _const(ir.VectorType(_i32, 32), idx))
    bit = _const(_V32I8, [1 << (4 * (g % 2) + k) for _ in range(8) for k in range(4)])
    is_set = builder.icmp_unsigned("==", builder.and_(spread, bit), bit)
    return builder.select(is_set, _const(_V32I8, [16] * 32), _const(_V32I8, [0] * 32))


def _q6_high(builder: ir.IRBuilder, crumbs: list, g: int, v: int, upper: bool) -> ir.Value:
    """Q6_K: 16 x the crumbs of group g (upper: g + 4) of rows 8v..; element e's crumb is in byte
    e % 8, bits 2 * (e // 8)."""
    bit = 2 * (g // 2) + (4 if upper else 0)
    return _bytes_and(builder, crumbs[g % 2][v], bit - 4, 0x30)


def unpack_quads(builder: ir.IRBuilder, args: list[ir.Value], high: str) -> None:
    """One 32-block of a 64-row tile -> QUADS_BYTES_AVX2 of unsigned quads; high: "" (4-bit), "q5"
    (h: 2 x 64 uint16 fifth-bit words) or "q6" (h: Q6_K's 8 x 64 crumb bytes)."""
    qp, hp, pp = (_ptr(builder, a) for a in args[:3])
    for line in range(16):
        _prefetch(builder, qp, PREFETCH_AHEAD + line * TILE_ROWS)
    if high == "q6":
        for line in range(8):
            _prefetch(builder, hp, PREFETCH_AHEAD // 2 + line * TILE_ROWS)
    crumbs = [row_quads(builder, hp, 4 * c) for c in range(2)] if high == "q6" else []
    for g in range(4):
        quads = row_quads(builder, qp, 4 * g)
        for v in range(VECS):
            lo, hi = _bytes_and(builder, quads[v], 0, 15), _bytes_and(builder, quads[v], 4, 15)
            if high == "q5":
                lo = builder.or_(lo, _fifth_bits(builder, hp, 0, v, g))
                hi = builder.or_(hi, _fifth_bits(builder, hp, 1, v, g))
            elif high == "q6":
                lo = builder.or_(lo, _q6_high(builder, crumbs, g, v, False))
                hi = builder.or_(hi, _q6_high(builder, crumbs, g, v, True))
            _store(builder, lo, pp, (g * VECS + v) * 32)
            _store(builder, hi, pp, ((g + 4) * VECS + v) * 32)


def _three_addresses(write, *options):
    """An intrinsic's (signature, codegen) for a kernel of three addresses written by
    write(builder, args, *options)."""

    def codegen(context, builder, signature, args):
        write(builder, args, *options)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def q4_unpack_quads_avx2(typingctx, q_addr, h_addr, p_addr):
    """One 32-block of a 64-row nibble tile (16 x 64 bytes; h unused) -> QUADS_BYTES_AVX2 of quads."""
    return _three_addresses(unpack_quads, "")


@intrinsic
def q5_unpack_quads_avx2(typingctx, q_addr, h_addr, p_addr):
    """q4_unpack_quads_avx2 plus the fifth bits (h: the block's 2 x 64 uint16 words): values 0..31."""
    return _three_addresses(unpack_quads, "q5")


@intrinsic
def q6_unpack_quads_avx2(typingctx, q_addr, h_addr, p_addr):
    """Q6_K: nibbles plus 16 x crumb (h: the block's 8 x 64 crumb bytes): values 0..63."""
    return _three_addresses(unpack_quads, "q6")


# Groups whose int16 pair sums can be added before widening, by the values' bit width.
_INT16_GROUPS = {4: 8, 5: 4, 6: 2}


def _x_quads(builder: ir.IRBuilder, xp: ir.Value) -> list[ir.Value]:
    out = []
    for g in range(8):
        quad = _load(builder, xp, 4 * g, _i32)
        v = builder.insert_element(ir.Constant(_V8I32, ir.Undefined), quad, _const(_i32, 0))
        out.append(builder.bitcast(builder.shuffle_vector(v, v, _const(_V8I32, [0] * 8)), _V32I8))
    return out


def _widened_sum(builder: ir.IRBuilder, products: list[ir.Value], per_int16: int) -> ir.Value:
    """The int32 per row of int16 pair sums: added in int16 `per_int16` at a time, then widened."""
    ones = _const(_V16I16, [1] * 16)
    total = None
    for start in range(0, len(products), per_int16):
        s16 = products[start]
        for p in products[start + 1 : start + per_int16]:
            s16 = builder.add(s16, p)
        s32 = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [s16, ones])
        total = s32 if total is None else builder.add(total, s32)
    return total


def quad_sums(builder: ir.IRBuilder, args: list[ir.Value], bits: int, split: bool) -> None:
    """s[r] = sum over the block of q * x for one activation row (plain-order int8 x) and the 64
    rows of an unpacked block; split: s[r] over elements 0..15 and s[64 + r] over 16..31."""
    pp, xp, sp = (_ptr(builder, a) for a in args[:3])
    xq = _x_quads(builder, xp)
    per_int16 = _INT16_GROUPS[bits]
    for v in range(VECS):
        products = []
        for g in range(8):
            w = _load(builder, pp, (g * VECS + v) * 32, _V32I8)
            products.append(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [w, xq[g]]))
        if split:
            _store(builder, _widened_sum(builder, products[:4], per_int16), sp, v * 32)
            _store(builder, _widened_sum(builder, products[4:], per_int16), sp, (TILE_ROWS + 8 * v) * 4)
        else:
            _store(builder, _widened_sum(builder, products, per_int16), sp, v * 32)


@intrinsic
def q4_quad_sums_avx2(typingctx, p_addr, x_addr, s_addr):
    """One activation row times a block unpacked by q4_unpack_quads_avx2: s[r] (int32, 64 rows)."""
    return _three_addresses(quad_sums, 4, False)


@intrinsic
def q5_quad_sums_avx2(typingctx, p_addr, x_addr, s_addr):
    """One activation row times a block unpacked by q5_unpack_quads_avx2: s[r] (int32, 64 rows)."""
    return _three_addresses(quad_sums, 5, False)


@intrinsic
def q6_quad_sums_avx2(typingctx, p_addr, x_addr, s_addr):
    """One activation row times a block unpacked by q6_unpack_quads_avx2: s[r] over elements 0..15,
    s[64 + r] over 16..31 (Q6_K's two scales)."""
    return _three_addresses(quad_sums, 6, True)


def quad_sums_vnni(builder: ir.IRBuilder, args: list[ir.Value], split: bool) -> None:
    """quad_sums with one `vpdpbusd` per 8 rows and group: eight int32 chains, one per 8-row vector
    (split: elements 0..15 then 16..31, each half's sums stored apart)."""
    pp, xp, sp = (_ptr(builder, a) for a in args[:3])
    xq = [builder.bitcast(x, _V8I32) for x in _x_quads(builder, xp)]
    for half in range(2) if split else (None,):
        groups = range(8) if half is None else range(4 * half, 4 * half + 4)
        acc = [ir.Constant(_V8I32, [0] * 8)] * VECS
        for g in groups:
            for v in range(VECS):
                w = _load(builder, pp, (g * VECS + v) * 32, _V8I32)
                acc[v] = _call(builder, VPDPBUSD256, _V8I32, [acc[v], w, xq[g]])
        for v in range(VECS):
            _store(builder, acc[v], sp, (TILE_ROWS * (half or 0) + 8 * v) * 4)


@intrinsic
def quad_sums_avxvnni(typingctx, p_addr, x_addr, s_addr):
    """q4_quad_sums_avx2 / q5_quad_sums_avx2 with the 256-bit `vpdpbusd` (HAVE_VNNI256 only): s[r]
    (int32, 64 rows) of any block q*_unpack_quads_avx2 wrote."""
    return _three_addresses(quad_sums_vnni, False)


@intrinsic
def quad_sums_split_avxvnni(typingctx, p_addr, x_addr, s_addr):
    """q6_quad_sums_avx2 with the 256-bit `vpdpbusd`: s[r] over elements 0..15, s[64 + r] over 16..31."""
    return _three_addresses(quad_sums_vnni, True)
