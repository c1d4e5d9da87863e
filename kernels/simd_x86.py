"""AVX2 block kernels written directly in LLVM IR (used through Numba intrinsics).

LLVM never turns scalar loops into `vpmaddubsw` (8-bit multiplies with pairwise int16 sums, 32
multiply-adds per instruction); these kernels ask for it by name and beat the best auto-vectorised
Numba loops by far.  They are only compiled where the host CPU has AVX2 (`HAVE_AVX2`); matmul_int
falls back to the portable loops elsewhere, and both give bit-identical integer sums (tests compare them).

Layout (packing.py): for one 32-block of a 64-row tile, byte j of each row lies at q[j * 64 + r];
its low nibble is element j, its high nibble element j + 16.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
from llvmlite import ir
from numba import config, types
from numba.extending import intrinsic

from .packing import TILE_ROWS
from .simd import call_intrinsic as _call


def _host_has_avx2() -> bool:
    try:
        return bool(llvm.get_host_cpu_features().get("avx2", False))
    except Exception:  # unknown host: use the portable kernels
        return False


HAVE_AVX2 = _host_has_avx2() and TILE_ROWS == 64


def _host_has_vnni256() -> bool:
    try:
        f = llvm.get_host_cpu_features()
        return bool(f.get("avxvnni", False) or (f.get("avx512vnni", False) and f.get("avx512vl", False)))
    except Exception:
        return False


# The 256-bit `vpdpbusd`: AVX-VNNI (VEX; Intel laptops and desktops since Alder Lake) or
# AVX512-VNNI with VL (EVEX).  LLVM picks the encoding from the CPU's features.  matmul_int and
# matmul_row take the *_avxvnni kernels only where AVX-512 is missing (simd_x512's are wider).
HAVE_VNNI256 = HAVE_AVX2 and _host_has_vnni256()
VPDPBUSD256 = "llvm.x86.avx512.vpdpbusd.256"

_i8, _i16, _i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32I8, _V16I16, _V8I16 = ir.VectorType(_i8, 32), ir.VectorType(_i16, 16), ir.VectorType(_i16, 8)
# vpunpcklbw / vpunpckhbw on 256 bits interleave within each 128-bit half: pairs for rows
# 0-7 and 16-23 (lo) or 8-15 and 24-31 (hi) of a 32-row half-tile.
_UNPACK = {
    "lo": [i for half in (0, 16) for b in range(8) for i in (half + b, 32 + half + b)],
    "hi": [i for half in (8, 24) for b in range(8) for i in (half + b, 32 + half + b)],
}
_ROWS = {"lo": (0, 16), "hi": (8, 24)}  # first row of each 8-lane group of the int16 result


def _const(ty: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(ty, values)


def _pair_broadcast(builder: ir.IRBuilder, xp: ir.Value, ja: int, jb: int) -> ir.Value:
    """The int8 pair (x[ja], x[jb]), repeated over 32 bytes."""
    a = builder.zext(builder.load(builder.gep(xp, [_const(_i32, ja)])), _i16)
    b = builder.zext(builder.load(builder.gep(xp, [_const(_i32, jb)])), _i16)
    pair = builder.or_(a, builder.shl(b, _const(_i16, 8)))
    v = builder.insert_element(ir.Constant(_V16I16, ir.Undefined), pair, _const(_i32, 0))
    v = builder.shuffle_vector(v, v, _const(ir.VectorType(_i32, 16), [0] * 16))
    return builder.bitcast(v, _V32I8)


# Software prefetch distance in bytes.  Decode streams every weight from DRAM once per token and
# the hardware prefetcher alone left each core well short of its memory bandwidth; fetching this
# far ahead lets the loads overlap the integer work.  Once one row went through a tile block by block
# (matmul_row), 4 KiB ahead took less time to consume than a DRAM miss takes: 8 KiB measured best of
# 4-16 KiB (docs/benchmarks.md, Design measurements).
PREFETCH_AHEAD = 8192
# CPUs (LLVM's names) whose hardware prefetchers stream the weights faster alone: on AMD Zen 4 the
# software prefetch held one core's Q4_K decode stream ~30% below (docs/benchmarks.md, Zen 4).  Zen 5
# is the other way round: there it streams 20-60% faster with it (docs/benchmarks.md, Zen 5).
_HARDWARE_STREAM_CPUS = ("znver4",)


def _cpu_name() -> str:
    try:
        return config.CPU_NAME or llvm.get_host_cpu_name()
    except Exception:  # unknown host: keep the software prefetch
        return ""


SOFTWARE_PREFETCH = _cpu_name() not in _HARDWARE_STREAM_CPUS


def _prefetch(builder: ir.IRBuilder, base: ir.Value, offset: int, every_cpu: bool = False) -> None:
    """The weight stream's prefetch of base + offset: nothing where SOFTWARE_PREFETCH is off, unless
    every_cpu (Q6_K's split and crumb kernels, ~7% slower on Zen 4 without it; the 4- and 5-bit
    unpack-once quads, whose prefill read 0.84-0.92x without it there)."""
    if not (SOFTWARE_PREFETCH or every_cpu):
        return
    ptr = builder.gep(base, [_const(_i32, offset)])
    flags = [_const(_i32, 0), _const(_i32, 3), _const(_i32, 1)]  # read, keep in all levels, data
    _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ptr, *flags])


def _ipair_broadcast(builder: ir.IRBuilder, xp: ir.Value, j: int) -> ir.Value:
    """Pair j of an interleaved block (quantize_act's x8p: x[j], x[16 + j]), over 32 bytes."""
    ptr = builder.bitcast(builder.gep(xp, [_const(_i32, 2 * j)]), _i16.as_pointer())
    pair = builder.load(ptr, align=1)
    v = builder.insert_element(ir.Constant(_V16I16, ir.Undefined), pair, _const(_i32, 0))
    v = builder.shuffle_vector(v, v, _const(ir.VectorType(_i32, 16), [0] * 16))
    return builder.bitcast(v, _V32I8)


def _nibbles(builder: ir.IRBuilder, qp: ir.Value, j: int, h: int) -> tuple[ir.Value, ir.Value]:
    """Low and high nibbles of byte j for the 32 rows of half h."""
    ptr = builder.bitcast(builder.gep(qp, [_const(_i32, j * TILE_ROWS + h * 32)]), _V32I8.as_pointer())
    v = builder.load(ptr, align=1)
    mask = _const(_V32I8, [15] * 32)
    return builder.and_(v, mask), builder.and_(builder.lshr(v, _const(_V32I8, [4] * 32)), mask)


def _pair_products(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, xv: ir.Value) -> dict:
    """Per row, a * xv[0] + b * xv[1] (int16), rows grouped as {"lo": .., "hi": ..} by _ROWS."""
    out = {}
    for part in ("lo", "hi"):
        pairs = builder.shuffle_vector(a, b, _const(ir.VectorType(_i32, 32), _UNPACK[part]))
        out[part] = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [pairs, xv])
    return out


def _store_rows(builder: ir.IRBuilder, acc: ir.Value, dst: ir.Value, h: int, part: str) -> None:
    """Store the 16 int16 lanes of acc (rows _ROWS[part] of half h, 8 each) in row order."""
    for g, first_row in enumerate(_ROWS[part]):
        sub = builder.shuffle_vector(acc, acc, _const(ir.VectorType(_i32, 8), list(range(8 * g, 8 * g + 8))))
        ptr = builder.gep(dst, [_const(_i32, h * 32 + first_row)])
        builder.store(sub, builder.bitcast(ptr, _V8I16.as_pointer()), align=2)


def _pointers(builder: ir.IRBuilder, args: list[ir.Value]) -> tuple[ir.Value, ...]:
    qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
    return qp, xp, builder.inttoptr(args[2], _i16.as_pointer()), builder.inttoptr(args[3], _i16.as_pointer())


def _accumulate(builder: ir.IRBuilder, acc: dict, key: tuple, products: dict) -> None:
    for part, value in products.items():
        k = (*key, part)
        acc[k] = builder.add(acc[k], value) if k in acc else value


def _store_all(builder: ir.IRBuilder, acc: dict, s0: ir.Value, s1: ir.Value) -> None:
    for (which, h, part), value in acc.items():
        _store_rows(builder, value, s0 if which == 0 else s1, h, part)


_SIG = types.void(types.int64, types.int64, types.int64, types.int64)


@intrinsic
def q4_block_sums_avx2(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """For one 32-block of a 64-row tile: s0[r] = sum over j < 8, s1[r] = over 8 <= j < 16, of
    lo(q[j, r]) * x[j] + hi(q[j, r]) * x[16 + j]  (int16; each <= 8 * 2 * 15 * 127 = 30480).
    Addresses: q 16 x 64 uint8, x 32 int8 interleaved (x[j], x[16 + j] at bytes 2j, 2j + 1, as
    quantize_act's x8p), s0/s1 64 int16."""

    def codegen(context, builder, signature, args):
        qp, xp, s0, s1 = _pointers(builder, args)
        acc: dict = {}
        for j in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * 64)
            xv = _ipair_broadcast(builder, xp, j)
            for h in range(2):
                low, high = _nibbles(builder, qp, j, h)
                _accumulate(builder, acc, (j // 8, h), _pair_products(builder, low, high, xv))
        _store_all(builder, acc, s0, s1)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def q4_block_sums_split_avx2(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """Like q4_block_sums_avx2 but s0 sums exactly the low nibbles (elements 0-15) and s1 the high
    ones (16-31), for Q6_K's one-scale-per-16 layout: pairs bytes j and j + 8 instead."""

    def codegen(context, builder, signature, args):
        qp, xp, s0, s1 = _pointers(builder, args)
        acc: dict = {}
        for j in range(8):
            x_low = _pair_broadcast(builder, xp, j, j + 8)
            x_high = _pair_broadcast(builder, xp, 16 + j, 24 + j)
            for h in range(2):
                low_a, high_a = _nibbles(builder, qp, j, h)
                low_b, high_b = _nibbles(builder, qp, j + 8, h)
                _accumulate(builder, acc, (0, h), _pair_products(builder, low_a, low_b, x_low))
                _accumulate(builder, acc, (1, h), _pair_products(builder, high_a, high_b, x_high))
        _store_all(builder, acc, s0, s1)
        return context.get_dummy_value()

    return _SIG, codegen


def _quad_broadcast(builder: ir.IRBuilder, xp: ir.Value, g: int) -> ir.Value:
    """x[4g .. 4g+3] as one int32, repeated over 32 bytes."""
    ptr = builder.bitcast(builder.gep(xp, [_const(_i32, 4 * g)]), _i32.as_pointer())
    quad = builder.load(ptr, align=1)
    v8 = ir.VectorType(_i32, 8)
    v = builder.insert_element(ir.Constant(v8, ir.Undefined), quad, _const(_i32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, _const(v8, [0] * 8)), _V32I8)


def _signed_quad_dot(builder: ir.IRBuilder, w: ir.Value, xv: ir.Value) -> ir.Value:
    """Per 32-bit lane: sum of the 4 int8 products w * x (|w| * sign(w) x, as ggml does)."""
    aw = _call(builder, "llvm.abs.v32i8", _V32I8, [w, ir.Constant(ir.IntType(1), 0)])
    sx = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, w])
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])
    ones = ir.Constant(_V16I16, [1] * 16)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_i32, 8), [pairs, ones])


def _q8_block_sums(builder: ir.IRBuilder, args: list[ir.Value], vnni: bool) -> None:
    """s[r] for one Q8_0 block (q8_block_sums_avx2).  vnni: one `vpdpbusd` per 8 rows x 4 elements on
    the weights biased to w + 128 (one xor), 128 x the block's activation sum taken off at the start."""
    qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
    sp = builder.inttoptr(args[2], _i32.as_pointer())
    v8 = ir.VectorType(_i32, 8)
    start = ir.Constant(v8, [0] * 8)
    if vnni:
        x32 = builder.load(builder.bitcast(xp, _V32I8.as_pointer()), align=1)
        xs = builder.sext(x32, ir.VectorType(_i32, 32))
        bias = builder.mul(_call(builder, "llvm.vector.reduce.add.v32i32", _i32, [xs]), _const(_i32, -128))
        v = builder.insert_element(ir.Constant(v8, ir.Undefined), bias, _const(_i32, 0))
        start = builder.shuffle_vector(v, v, _const(v8, [0] * 8))
    acc = [start] * (TILE_ROWS // 8)
    for g in range(8):
        for line in range(4):
            _prefetch(builder, qp, PREFETCH_AHEAD + g * 256 + line * 64)
        xv = _quad_broadcast(builder, xp, g)
        for rv in range(TILE_ROWS // 8):
            ptr = builder.gep(qp, [_const(_i32, (g * TILE_ROWS + rv * 8) * 4)])
            w = builder.load(builder.bitcast(ptr, _V32I8.as_pointer()), align=1)
            if vnni:
                w = builder.bitcast(builder.xor(w, _const(_V32I8, [-128] * 32)), v8)
                acc[rv] = _call(builder, VPDPBUSD256, v8, [acc[rv], w, builder.bitcast(xv, v8)])
            else:
                acc[rv] = builder.add(acc[rv], _signed_quad_dot(builder, w, xv))
    for rv, value in enumerate(acc):
        ptr = builder.gep(sp, [_const(_i32, rv * 8)])
        builder.store(value, builder.bitcast(ptr, v8.as_pointer()), align=4)


@intrinsic
def q8_block_sums_avx2(typingctx, q_addr, x_addr, s_addr, unused):
    """One Q8_0 32-block of a 64-row tile in quad layout (8 quads x 64 rows x 4 int8):
    s[r] = sum_e q[r, e] * x[e] as int32 (|products| <= 128 * 127, pairs fit int16)."""

    def codegen(context, builder, signature, args):
        _q8_block_sums(builder, args, False)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def q8_block_sums_avxvnni(typingctx, q_addr, x_addr, s_addr, unused):
    """q8_block_sums_avx2 with the 256-bit `vpdpbusd` (HAVE_VNNI256 only): the same int32 sums."""

    def codegen(context, builder, signature, args):
        _q8_block_sums(builder, args, True)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- many activation rows: unpack a block's nibbles once, reuse them for every row ---------------
# The 64 pair vectors of one 32-block (16 byte pairs x 2 half-tiles x lo/hi rows) are written to a
# 2 KiB scratch that stays in L1; each activation row then costs 64 `vpmaddubsw` + adds instead of
# also re-doing the masks, shifts and shuffles (layer matmuls of 16 rows ran much faster).
PAIRS_BYTES = 16 * 2 * 2 * 32


def _pairs_slot(j: int, h: int, part: str) -> int:
    return ((j * 2 + h) * 2 + (0 if part == "lo" else 1)) * 32


@intrinsic
def q4_unpack_pairs_avx2(typingctx, q_addr, p_addr):
    """One 32-block of a 64-row tile (16 x 64 packed bytes) -> PAIRS_BYTES of (lo, hi) nibble pairs
    in the order q4_pair_sums_avx2 reads them."""

    def codegen(context, builder, signature, args):
        qp, pp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        for j in range(16):
            _prefetch(builder, qp, PREFETCH_AHEAD + j * 64)
            for h in range(2):
                low, high = _nibbles(builder, qp, j, h)
                for part in ("lo", "hi"):
                    mask = _const(ir.VectorType(_i32, 32), _UNPACK[part])
                    pairs = builder.shuffle_vector(low, high, mask)
                    ptr = builder.gep(pp, [_const(_i32, _pairs_slot(j, h, part))])
                    builder.store(pairs, builder.bitcast(ptr, _V32I8.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


def pair_sums_codegen(product: Any) -> Any:
    """Codegen of a block's integer sums from unpacked value pairs (the `_pairs_slot` layout that
    q4_unpack_pairs_avx2 and the MXFP4 unpacker write): `product(builder, pairs, xv)` multiplies one
    vector of weight pairs by the broadcast activations (unsigned Q4 nibbles, or signed MXFP4 values)."""

    def codegen(context, builder, signature, args):
        pp, xp, s0, s1 = _pointers(builder, args)
        acc: dict = {}
        for j in range(16):
            xv = _ipair_broadcast(builder, xp, j)
            for h in range(2):
                products = {}
                for part in ("lo", "hi"):
                    ptr = builder.gep(pp, [_const(_i32, _pairs_slot(j, h, part))])
                    pairs = builder.load(builder.bitcast(ptr, _V32I8.as_pointer()), align=1)
                    products[part] = product(builder, pairs, xv)
                _accumulate(builder, acc, (j // 8, h), products)
        _store_all(builder, acc, s0, s1)
        return context.get_dummy_value()

    return codegen


def _unsigned_pmadd(builder: ir.IRBuilder, pairs: ir.Value, xv: ir.Value) -> ir.Value:
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [pairs, xv])


@intrinsic
def q4_pair_sums_avx2(typingctx, p_addr, x_addr, s0_addr, s1_addr):
    """q4_block_sums_avx2 from unpacked pairs (q4_unpack_pairs_avx2): the same integer sums
    (x interleaved likewise)."""
    return _SIG, pair_sums_codegen(_unsigned_pmadd)


# ---- Q8_0 weights x int16 activations: the precise output projection ------------------------------
_V16I8, _V4I64 = ir.VectorType(_i8, 16), ir.VectorType(ir.IntType(64), 4)


def _quad16_broadcast(builder: ir.IRBuilder, xp: ir.Value, g: int) -> ir.Value:
    """x16[4g .. 4g+3] (int16) as one int64, repeated over 256 bits."""
    ptr = builder.bitcast(builder.gep(xp, [_const(_i32, 8 * g)]), ir.IntType(64).as_pointer())
    v = builder.insert_element(ir.Constant(_V4I64, ir.Undefined), builder.load(ptr, align=1), _const(_i32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, _const(ir.VectorType(_i32, 4), [0] * 4)), _V16I16)


@intrinsic
def q8_block_sums16_avx2(typingctx, q_addr, x_addr, s_addr, unused):
    """One Q8_0 32-block of a 64-row tile (quad layout, as q8_block_sums_avx2) times 32 int16
    activations: s[r] = sum_e q[r, e] * x[e] (int32; |s| <= 32 * 128 * 32767 < 2**31).  (No AVX-VNNI
    form: for Alder Lake LLVM splits `vpdpwssd` back into this `vpmaddwd` + `vpaddd`.)"""

    def codegen(context, builder, signature, args):
        qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        sp = builder.inttoptr(args[2], _i32.as_pointer())
        v8 = ir.VectorType(_i32, 8)
        for half in range(2):  # 4 row groups at a time: 8 accumulators stay in registers
            acc: dict = {}
            for g in range(8):
                xv = _quad16_broadcast(builder, xp, g)
                for rv in range(4 * half, 4 * half + 4):
                    if rv % 2 == 0:  # a line ahead per 64 bytes, as simd_x512's form
                        _prefetch(builder, qp, PREFETCH_AHEAD + (g * TILE_ROWS + rv * 8) * 4)
                    ptr = builder.gep(qp, [_const(_i32, (g * TILE_ROWS + rv * 8) * 4)])
                    w = builder.load(builder.bitcast(ptr, _V32I8.as_pointer()), align=1)
                    for part in range(2):  # rows rv*8 + 0..3, then + 4..7
                        sel = _const(ir.VectorType(_i32, 16), list(range(16 * part, 16 * part + 16)))
                        w16 = builder.sext(builder.shuffle_vector(w, w, sel), _V16I16)
                        p = _call(builder, "llvm.x86.avx2.pmadd.wd", v8, [w16, xv])
                        acc[(rv, part)] = builder.add(acc[(rv, part)], p) if (rv, part) in acc else p
            for rv in range(4 * half, 4 * half + 4):
                # lanes (2i, 2i+1) of part p hold row 4p + i's two halves: add them pairwise
                # (vphaddd works per 128-bit lane, hence the reorder) -> rows rv*8 .. rv*8+7
                both = _call(builder, "llvm.x86.avx2.phadd.d", v8, [acc[(rv, 0)], acc[(rv, 1)]])
                rows = builder.shuffle_vector(both, both, _const(v8, [0, 1, 4, 5, 2, 3, 6, 7]))
                ptr = builder.gep(sp, [_const(_i32, rv * 8)])
                builder.store(rows, builder.bitcast(ptr, v8.as_pointer()), align=4)
        return context.get_dummy_value()

    return _SIG, codegen


# ---- Q6_K: pairs widened to int16 lanes, so results come out in row order ---------------------------
# Each row's byte is zero-extended to 16 bits; shifts and masks put one element in the low byte and
# its partner in the high byte, and `vpmaddubsw` against the pair (x[a], x[b]) gives that row's
# a * x[a] + b * x[b] in the same lane: no cross-row shuffles and no reorder before the stores.
PMADDUBS = {16: "llvm.x86.avx2.pmadd.ub.sw", 32: "llvm.x86.avx512.pmaddubs.w.512"}


def _widened(builder: ir.IRBuilder, qp: ir.Value, offset: int, lanes: int) -> ir.Value:
    ptr = builder.bitcast(builder.gep(qp, [_const(_i32, offset)]), ir.VectorType(_i8, lanes).as_pointer())
    return builder.zext(builder.load(ptr, align=1), ir.VectorType(_i16, lanes))


def _splat(builder: ir.IRBuilder, v: ir.Value, value: int) -> ir.Constant:
    return _const(v.type, [value] * v.type.count)


def crumb_pairs(builder: ir.IRBuilder, qp: ir.Value, j: int, h: int, lanes: int) -> list:
    """Q6_K's crumb byte j (elements j, 8+j, 16+j, 24+j in bits 0-1, 2-3, 4-5, 6-7) of rows
    h*lanes..: pairs (j, 8+j) and (16+j, 24+j), one per int16 lane."""
    v = _widened(builder, qp, j * TILE_ROWS + h * lanes, lanes)
    lo = builder.or_(v, builder.shl(v, _splat(builder, v, 6)))
    hi = builder.or_(builder.lshr(v, _splat(builder, v, 4)), builder.shl(v, _splat(builder, v, 2)))
    m = _splat(builder, v, 0x0303)
    return [(builder.and_(lo, m), (j, 8 + j)), (builder.and_(hi, m), (16 + j, 24 + j))]


def split_pairs(builder: ir.IRBuilder, qp: ir.Value, j: int, h: int, lanes: int) -> list:
    """Nibble bytes j and j+8 of rows h*lanes..: low nibbles (elements j, 8+j) and high ones
    (16+j, 24+j) as pairs, one per int16 lane."""
    a = _widened(builder, qp, j * TILE_ROWS + h * lanes, lanes)
    b = _widened(builder, qp, (j + 8) * TILE_ROWS + h * lanes, lanes)
    high_byte = _splat(builder, a, 0x0F00)
    lo = builder.and_(a, _splat(builder, a, 15))
    lo = builder.or_(lo, builder.and_(builder.shl(b, _splat(builder, b, 8)), high_byte))
    hi = builder.lshr(a, _splat(builder, a, 4))
    hi = builder.or_(hi, builder.and_(builder.shl(b, _splat(builder, b, 4)), high_byte))
    return [(lo, (j, 8 + j)), (hi, (16 + j, 24 + j))]


def widened_pair_sums(builder: ir.IRBuilder, args: list[ir.Value], lanes: int, pairs_of, lines: int) -> None:
    """s0[r] / s1[r] = the int16 sums over j < 8 of the first / second pair pairs_of gives, times
    plain-order x; `lines` 64-byte weight lines per block to prefetch."""
    qp, xp, s0, s1 = _pointers(builder, args)
    vb = ir.VectorType(_i8, 2 * lanes)
    for line in range(lines):
        _prefetch(builder, qp, PREFETCH_AHEAD + line * TILE_ROWS, every_cpu=True)
    for h in range(TILE_ROWS // lanes):
        acc: list = [None, None]
        for j in range(8):
            for which, (pair, (ja, jb)) in enumerate(pairs_of(builder, qp, j, h, lanes)):
                xv = _pair_broadcast(builder, xp, ja, jb)
                if lanes == 32:
                    xv = builder.shuffle_vector(xv, xv, _const(ir.VectorType(_i32, 64), list(range(32)) * 2))
                p = _call(builder, PMADDUBS[lanes], pair.type, [builder.bitcast(pair, vb), xv])
                acc[which] = p if acc[which] is None else builder.add(acc[which], p)
        for dst, value in zip((s0, s1), acc, strict=True):
            ptr = builder.gep(dst, [_const(_i32, h * lanes)])
            builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=2)


@intrinsic
def crumb_sums_avx2(typingctx, q_addr, x_addr, s0_addr, s1_addr):
    """One 32-block of a 64-row tile of Q6_K's crumbs (8 x 64 bytes) times plain-order int8 x:
    s0[r] = sum of the first 16 elements' crumb * x, s1 the last 16's (int16, <= 16 * 3 * 128)."""

    def codegen(context, builder, signature, args):
        widened_pair_sums(builder, args, 16, crumb_pairs, 8)
        return context.get_dummy_value()

    return _SIG, codegen


@intrinsic
def q5_high_sums_avx2(typingctx, qh_addr, x_addr, s_addr, unused):
    """One 32-block of a 64-row tile: s[r] = the sum of x over the elements whose fifth bit is set
    (int16, |s| <= 4064), as matmul_int.high_bit_sums. qh: 2 x 64 uint16 (bit j of word w is element
    16w + j); x: the block's 32 int8 pair-interleaved (element j at 2j, 16 + j at 2j + 1, as x8p).
    AVX2 has no 16-bit permute for AVX-512's table lookup: each bit becomes a lane mask (shift it to
    the sign, shift it back arithmetically) that selects the broadcast x, sixteen rows a register."""

    def codegen(context, builder, signature, args):
        qp, xp = builder.inttoptr(args[0], _i8.as_pointer()), builder.inttoptr(args[1], _i8.as_pointer())
        sp = builder.inttoptr(args[2], _i16.as_pointer())
        words = {}
        for w in range(2):
            for q in range(TILE_ROWS // 16):
                ptr = builder.bitcast(
                    builder.gep(qp, [_const(_i32, (w * TILE_ROWS + 16 * q) * 2)]), _V16I16.as_pointer()
                )
                words[w, q] = builder.load(ptr, align=2)
        acc: list[Any] = [None] * (TILE_ROWS // 16)
        for w in range(2):
            for j in range(16):
                xj = builder.sext(builder.load(builder.gep(xp, [_const(_i32, 2 * j + w)])), _i16)
                xb = builder.insert_element(ir.Constant(_V16I16, ir.Undefined), xj, _const(_i32, 0))
                xb = builder.shuffle_vector(xb, xb, _const(ir.VectorType(_i32, 16), [0] * 16))
                for q in range(TILE_ROWS // 16):
                    m = builder.shl(words[w, q], _const(_V16I16, [15 - j] * 16))
                    part = builder.and_(builder.ashr(m, _const(_V16I16, [15] * 16)), xb)
                    acc[q] = part if acc[q] is None else builder.add(acc[q], part)
        for q in range(TILE_ROWS // 16):
            ptr = builder.bitcast(builder.gep(sp, [_const(_i32, 16 * q)]), _V16I16.as_pointer())
            builder.store(acc[q], ptr, align=2)
        return context.get_dummy_value()

    return _SIG, codegen
