"""Quantized linear layers: y (T, N) = x (T, K) @ W.T for a PackedWeight W (see packing.py).

Two paths, both split over tiles of TILE_ROWS weight rows (each thread owns a contiguous range):
  * integer path (quantized "lane" kinds): activations are quantized to int8 per 32-block, each
    weight block is loaded once and used for all T rows, products are summed in int16/int32 lanes
    and scales applied per block.  With AVX2 it is used for every T (decode and prefill).
  * float path (F32/F16/BF16/Q2_K/Q3_K, and many rows without AVX2): a tile is dequantized to
    float32 once and fed to a 3x3 register-blocked GEMM over all T rows.  Exact float math.

Compilation: each (kind, path) is a C callback ("range kernel": does tiles lo..hi) compiled on
first use and cached on disk, and one parallel launcher calls any of them through its address.
So a model compiles only the kinds it uses, and the costly parallel (parfor) compilation happens
once for all kinds.  Inside a range kernel `kind` is a compile-time constant and the per-kind
code is chosen while typing (`@overload`), so each kind compiles only its own code (Numba does not
prune `if kind == ...` branches; compiling every kind into every kernel cost minutes).
The on-disk cache is keyed by all kernel sources (cache.py): an edit to any kernel file, a constant
such as packing.TILE_ROWS included, compiles afresh.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
from numba import carray, cfunc, errors, njit, prange, types
from numba.extending import overload

from . import blockscales as bs
from . import dequant as dq
from . import matmul_int as mi
from . import matmul_mxfp4 as mx
from . import matmul_row as mr
from .act_rounding import ROUND_NONE, ROUND_Q8_0, ROUND_Q8_1, ROUND_Q8_K
from .gemm import GEMM_ARGV_LEN, call_gemm
from .packing import (
    BF16,
    F16,
    F32,
    LANE_KINDS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    PackedWeight,
    layout,
    pack_weight,
)
from .packing import TILE_ROWS as R
from .pieces import plan_pieces
from .quantize_act import quantize_rows, quantize_rows16, with_residual
from .refine import mark_tiles
from .simd import (
    RANGE_KERNEL_SIG,
    call_range_kernel,
    f32,
    fetch_add,
    prefetch,
    ptr_f32,
    ptr_i8,
    ptr_i16,
    ptr_i32,
    ptr_i64,
    ptr_u8,
)
from .simd_x86 import PAIRS_BYTES

# Quantized kinds use the integer path up to this many activation rows, the float path above.
# With the AVX2 kernels the integer path is faster at every T, from one row to a 512-row prefill
# (docs/benchmarks.md, Design measurements) and, like llama.cpp, prefill uses it too.  The portable
# loops (no AVX2: ARM, old x86) would be faster on the float path for larger batches, but the two
# paths round differently, so a row's result would depend on its batch (a token decoded alone vs
# among 16 sequences, a speculative verify step vs plain decode): every T takes the integer path.
INT_PATH_MAX_T = 1 << 30
# Below this many weight bytes x rows, one thread beats paying for a parallel launch.
PARALLEL_MIN_WORK = 96 * 1024

# Decode prefetches the first this many bytes of the next tile's scale fields as a tile starts (the
# hardware prefetcher follows from there): prefetching the whole of them cost time in cache, with no
# gain from memory.
SCALE_PREFETCH_BYTES = 1024

# The float path dequantizes this many rows at a time: (32, K) float32 stays in L2 next to x.
FLOAT_ROWS = 32

# argv slots shared by all range kernels
A_BUF, A_NBYTES, A_N, A_K, A_T, A_X, A_Y, A_X8, A_DX, A_SX, A_HS, A_IDS, A_GEMM, A_LDY, A_X8P = range(15)
ARGV_LEN = 15  # A_Y points at column 0 of this weight's output; A_LDY is y's row length

# launch tables (group_table): a row per weight
T_FN, T_BUF, T_NBYTES, T_N, T_K, T_ROUND = range(6)
TABLE_LEN = 6
# how a weight's int8 activations are rounded (T_ROUND): act_rounding.ROUND_*, llama.cpp's for its type
ROUNDING_OF_KIND = {Q4_K: ROUND_Q8_K, Q5_K: ROUND_Q8_K, Q6_K: ROUND_Q8_K, Q4_1: ROUND_Q8_1, Q5_1: ROUND_Q8_1}


def rounding_of(kind: int) -> int:
    """The activation rounding llama.cpp's CPU back end uses before a matmul with this kind (none for
    the kinds that take the float path)."""
    return ROUNDING_OF_KIND.get(kind, ROUND_Q8_0) if kind in LANE_KINDS else ROUND_NONE


def precise_rounding(rounding: int | np.ndarray) -> np.ndarray:
    """The rounding (an int, or an array of them) of a near-float two-pass projection: Q8_1's float16
    sums would stay in its result (the residual pass does not see them), so exact Q8_0 sums instead."""
    return np.where(np.equal(rounding, ROUND_Q8_1), ROUND_Q8_0, rounding)


# ---- field views ------------------------------------------------------------------------------


@njit(cache=True)
def _flat(kind, buf, n, k):
    """The four packed fields of a lane kind, flat: f0 as uint16 (fp16 scales), f1, f2, qs as uint8."""
    o1, o2, o3, total = layout(kind, n, k)
    return buf[0:o1].view(np.uint16), buf[o1:o2], buf[o2:o3], buf[o3:total]


@njit(cache=True)
def _nib_views(kind, buf, n, k):
    f0, f1, f2, q = _flat(kind, buf, n, k)
    nt, nb, ns = (n + R - 1) // R, k // 32, k // 256
    return f0, f1, f2, q.reshape(nt, nb, 16, R), nt, nb, ns


@njit(cache=True)
def _no_qh(nb):
    """The qh of a 4-bit kind: one tile of zero blocks (so qh[0] is an empty (0, 2, R))."""
    return np.zeros((1, 0, 2, R), np.uint16)


@njit(cache=True)
def fields_q4_0(buf, n, k, t, dsc, msc):
    f0, _, _, qs, nt, nb, _ = _nib_views(Q4_0, buf, n, k)
    bs.scales_d(f0.reshape(nt, nb, R), t, f32(8.0), dsc, msc)
    return qs, _no_qh(nb)


@njit(cache=True)
def fields_q4_1(buf, n, k, t, dsc, msc):
    f0, _, _, qs, nt, nb, _ = _nib_views(Q4_1, buf, n, k)
    bs.scales_dm(f0.reshape(nt, nb, 2, R), t, dsc, msc)
    return qs, _no_qh(nb)


@njit(cache=True)
def fields_q4_k(buf, n, k, t, dsc, msc):
    f0, sm, _, qs, nt, nb, ns = _nib_views(Q4_K, buf, n, k)
    bs.scales_k(f0.reshape(nt, ns, 2, R), sm.reshape(nt, nb, 2, R), t, dsc, msc)
    return qs, _no_qh(nb)


@njit(cache=True)
def fields_q5_0(buf, n, k, t, dsc, msc):
    f0, qh, _, qs, nt, nb, _ = _nib_views(Q5_0, buf, n, k)
    bs.scales_d(f0.reshape(nt, nb, R), t, f32(16.0), dsc, msc)
    return qs, qh.view(np.uint16).reshape(nt, nb, 2, R)


@njit(cache=True)
def fields_q5_1(buf, n, k, t, dsc, msc):
    f0, qh, _, qs, nt, nb, _ = _nib_views(Q5_1, buf, n, k)
    bs.scales_dm(f0.reshape(nt, nb, 2, R), t, dsc, msc)
    return qs, qh.view(np.uint16).reshape(nt, nb, 2, R)


@njit(cache=True)
def fields_q5_k(buf, n, k, t, dsc, msc):
    f0, qh, sm, qs, nt, nb, ns = _nib_views(Q5_K, buf, n, k)
    bs.scales_k(f0.reshape(nt, ns, 2, R), sm.reshape(nt, nb, 2, R), t, dsc, msc)
    return qs, qh.view(np.uint16).reshape(nt, nb, 2, R)


NIBBLE_FIELDS = {Q4_0: fields_q4_0, Q4_1: fields_q4_1, Q4_K: fields_q4_k}
NIBBLE_FIELDS.update({Q5_0: fields_q5_0, Q5_1: fields_q5_1, Q5_K: fields_q5_k})


@njit(cache=True)
def _q8_fields(buf, n, k):
    f0, _, _, q = _flat(Q8_0, buf, n, k)
    nt, nb = (n + R - 1) // R, k // 32
    return f0.reshape(nt, nb, R), q.view(np.int8).reshape(nt, nb, 8, R, 4)


@njit(cache=True)
def _q6_fields(buf, n, k):
    f0, f1, f2, q = _flat(Q6_K, buf, n, k)
    nt, nb, ns = (n + R - 1) // R, k // 32, k // 256
    sc, qh2 = f1.view(np.int8).reshape(nt, nb, 2, R), f2.reshape(nt, nb, 8, R)
    return f0.reshape(nt, ns, R), sc, qh2, q.reshape(nt, nb, 16, R)


@njit(cache=True)
def _mxfp4_fields(buf, n, k):
    """MXFP4's exponents (nt, nb, R) and codes (nt, nb, 16, R)."""
    _, e, _, q = _flat(MXFP4, buf, n, k)
    nt, nb = (n + R - 1) // R, k // 32
    return e.reshape(nt, nb, R), q.reshape(nt, nb, 16, R)


@njit(cache=True)
def tile_views(kind, buf, n, k):
    """All tiles' fields as matmul_row.row_nibbles takes them, indexed [t]: (f0, sm, qh, qs).  Built
    once per range call: building them per tile cost a sizeable share of a decode tile's time."""
    f0, f1, f2, qs, nt, nb, ns = _nib_views(kind, buf, n, k)
    sm, qh = f1[:0].reshape(nt, 0, 2, R), f0[:0].reshape(nt, 0, 2, R)  # none
    if kind == Q4_K or kind == Q5_K:
        d = f0.reshape(nt, ns, 2, R)
        sm = (f2 if kind == Q5_K else f1).reshape(nt, nb, 2, R)
    elif kind == Q4_1 or kind == Q5_1:
        d = f0.reshape(nt, nb, 2, R)
    else:
        d = f0.reshape(nt, nb, 1, R)
    if kind == Q5_0 or kind == Q5_1 or kind == Q5_K:
        qh = f1.view(np.uint16).reshape(nt, nb, 2, R)
    return d, sm, qh, qs


def int_views(kind, buf, n, k):
    """The fields int_tile reads, for all tiles (kind-specific tuple).  (Numba only.)"""
    raise NotImplementedError


@overload(int_views, jit_options={"cache": True})
def _int_views_impl(kind, buf, n, k):
    kv = _literal_kind(kind)
    if kv == Q8_0:
        return lambda kind, buf, n, k: _q8_fields(buf, n, k)
    if kv == Q6_K:
        return lambda kind, buf, n, k: _q6_fields(buf, n, k)
    if kv == MXFP4:
        return lambda kind, buf, n, k: _mxfp4_fields(buf, n, k)
    return lambda kind, buf, n, k: tile_views(kv, buf, n, k)


# ---- per-tile work, chosen per kind while typing (so each kind compiles only its own code) -------


def _literal_kind(kind) -> int:
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("the weight kind must be a compile-time constant")
    return kind.literal_value


def int_tile(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs) -> None:
    """acc (T, R) += tile t of W times the quantized rows xq = (x8, dx, sx, hs, x8p, bit tables);
    views: int_views(kind, buf, n, k).  (Numba only.)"""
    raise NotImplementedError


@overload(int_tile, jit_options={"cache": True}, inline="always")
def _int_tile_impl(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs):
    kv = _literal_kind(kind)
    if kv == Q8_0:

        def q8(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs):
            d, q8 = views
            if not mr.fused_q8_0(d[t], q8[t], xq[0], xq[1], acc, s32[0]):
                mi.tile_q8_0(d[t], q8[t], xq[0], xq[1], acc, s32)

        return q8
    if kv == Q6_K:

        def q6(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs):
            d, sc, qh2, qs = views
            x8, dx, hs = xq[0], xq[1], xq[3]
            if not mr.fused_q6_k(d[t], sc[t], qh2[t], qs[t], x8, dx, hs, acc, s32[:2], pairs):
                mi.tile_q6_k(d[t], sc[t], qh2[t], qs[t], x8, dx, hs, acc, s16, sums, pairs)

        return q6
    if kv == MXFP4:

        def mxfp4(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs):
            e, qs = views  # s32: (2, R) int32 here (fused_limit), room for the (2, R) int16 sums
            s16v = carray(ptr_i16(s32.ctypes.data), (2, R))
            mx.tile_mxfp4(e[t], qs[t], xq[0], xq[4], xq[1], xq[3], acc, s16v, pairs)

        return mxfp4
    fields, fused_rows = NIBBLE_FIELDS[kv], mr.NIBBLE_ROWS.get(kv, 0)

    def nibbles(kind, views, buf, n, k, t, xq, acc, s16, s32, sums, dsc, msc, pairs):
        d, sm, qh, qs = views
        if xq[0].shape[0] <= fused_rows:
            if mr.fused_nibbles(kv, d[t], sm[t], qh[t], qs[t], xq[0], xq[4], xq[5], xq[1], xq[2], acc, pairs):
                return
        x8, x8p, bits, dx, sx = xq[0], xq[4], xq[5], xq[1], xq[2]
        if kv == Q4_K or kv == Q5_K:  # superblock.k_step from the fields, no per-block scales
            mi.tile_nibbles(qs[t], qh[t], x8, x8p, bits, dx, sx, dsc, msc, d[t], sm[t], acc, s16, sums, pairs)
            return
        qs, qh = fields(buf, n, k, t, dsc, msc)
        qh3 = qh[t] if qh.shape[1] > 0 else qh[0]
        none = d[t][:0]
        mi.tile_nibbles(qs[t], qh3, x8, x8p, bits, dx, sx, dsc, msc, none, sm[t], acc, s16, sums, pairs)

    return nibbles


def deq_tile(kind, buf, n, k, t, r0, r1, out) -> None:
    """Rows t*R + r0 .. t*R + r1 - 1 of W as float32 into out[0 : r1 - r0].  (Numba only.)"""
    raise NotImplementedError


@overload(deq_tile, jit_options={"cache": True})
def _deq_tile_impl(kind, buf, n, k, t, r0, r1, out):
    kv = _literal_kind(kind)
    if kv in ROW_DEQUANT:
        return ROW_DEQUANT[kv]
    if kv == Q8_0:

        def q8(kind, buf, n, k, t, r0, r1, out):
            d, q8 = _q8_fields(buf, n, k)
            dq.deq_q8_0(d, q8, t, r0, r1, out)

        return q8
    if kv == Q6_K:

        def q6(kind, buf, n, k, t, r0, r1, out):
            d, sc, qh2, qs = _q6_fields(buf, n, k)
            dq.deq_q6_k(d, sc, qh2, qs, t, r0, r1, out)

        return q6
    if kv == MXFP4:

        def mxfp4(kind, buf, n, k, t, r0, r1, out):
            e, qs = _mxfp4_fields(buf, n, k)
            mx.deq_mxfp4(e, qs, t, r0, r1, out)

        return mxfp4
    fields = NIBBLE_FIELDS[kv]

    def nibbles(kind, buf, n, k, t, r0, r1, out):
        dsc = np.empty((k // 32, R), np.float32)
        msc = np.empty((k // 32, R), np.float32)
        qs, qh = fields(buf, n, k, t, dsc, msc)
        dq.deq_nibbles(qs, qh, t, r0, r1, dsc, msc, out)

    return nibbles


def _row_f32(kind, buf, n, k, t, r0, r1, out):
    dq.deq_rows_f32(buf.view(np.float32).reshape(n, k), t * R + r0, t * R + r1, out)


def _row_f16(kind, buf, n, k, t, r0, r1, out):
    dq.deq_rows_f16(buf.view(np.uint16).reshape(n, k), t * R + r0, t * R + r1, out)


def _row_bf16(kind, buf, n, k, t, r0, r1, out):
    dq.deq_rows_bf16(buf.view(np.uint16).reshape(n, k), t * R + r0, t * R + r1, out)


def _row_q2_k(kind, buf, n, k, t, r0, r1, out):
    dq.deq_rows_q2_k(buf.reshape(n, k // 256 * 84), t * R + r0, t * R + r1, out)


def _row_q3_k(kind, buf, n, k, t, r0, r1, out):
    dq.deq_rows_q3_k(buf.reshape(n, k // 256 * 110), t * R + r0, t * R + r1, out)


ROW_DEQUANT = {F32: _row_f32, F16: _row_f16, BF16: _row_bf16, Q2_K: _row_q2_k, Q3_K: _row_q3_k}


@njit(cache=True)
def _store(acc, y, t, n) -> None:
    for ti in range(acc.shape[0]):
        for r in range(min(R, n - t * R)):
            y[ti, t * R + r] = acc[ti, r]


# ---- range kernels: the bodies of the C callbacks ---------------------------------------------


@njit(cache=True)
def _buf(argv):
    return carray(ptr_u8(argv[A_BUF]), (argv[A_NBYTES],))


@njit(cache=True, inline="always")
def _prefetch_field(base, lo, hi, nt, t) -> None:
    """Prefetch tile t's part of the field at bytes lo..hi of a packed weight (nt equal tiles)."""
    size = (hi - lo) // nt
    for off in range(0, min(size, SCALE_PREFETCH_BYTES), 64):
        prefetch(base + lo + t * size + off)


@njit(cache=True)
def _prefetch_scales(kind, buf, n, k, t) -> None:
    """Prefetch tile t's small fields (scales; Q5's fifth bits): the block kernels prefetch the
    quants (and Q6_K's crumbs, its third field) ahead of their loads, but a tile's scales are read
    in one burst, and for one activation row those misses stalled every tile."""
    o1, o2, o3, _ = layout(kind, n, k)
    nt, base = (n + R - 1) // R, buf.ctypes.data
    _prefetch_field(base, 0, o1, nt, t)
    _prefetch_field(base, o1, o2, nt, t)
    if kind != Q6_K:
        _prefetch_field(base, o2, o3, nt, t)


@njit(cache=True)
def int_range(kind, argv, lo, hi) -> int:
    """Integer path over tiles lo..hi."""
    buf, n, k, T = _buf(argv), argv[A_N], argv[A_K], argv[A_T]
    x8 = carray(ptr_i8(argv[A_X8]), (T, k))
    dx = carray(ptr_f32(argv[A_DX]), (T, k // 32))
    sx = carray(ptr_f32(argv[A_SX]), (T, k // 32))
    hs = carray(ptr_i32(argv[A_HS]), (T, k // 16))
    x8p = carray(ptr_i8(argv[A_X8P]), (T, k))
    y = carray(ptr_f32(argv[A_Y]), (T, argv[A_LDY]))
    acc, s16, s32, sums, dsc, msc, pairs, scratch = _int_scratch(kind, T, k)
    five = kind == Q5_0 or kind == Q5_1 or kind == Q5_K  # built once per call, used by every tile
    no_bits = carray(ptr_i16(argv[A_X8]), (T, 0))  # (an allocation saved for the other kinds)
    bits = np.empty((T, k // 32 * mi.BIT_TABLE_LEN), np.int16) if five else no_bits
    # only rows for the direct kernels (a 512-row prefill wrote 7 MB of tables per call for none)
    lo_bits = 0 if T <= mr.FUSED_MAX_ROWS else mi.first_direct_row(T)
    mi.bit_tables(x8[lo_bits:], bits[lo_bits:])
    views = int_views(kind, buf, n, k)
    for t in range(lo, hi):
        if T == 1 and t + 1 < hi:  # decode: the next tile's scales arrive while this one computes
            _prefetch_scales(kind, buf, n, k, t + 1)
        acc[:] = 0.0
        int_tile(kind, views, buf, n, k, t, (x8, dx, sx, hs, x8p, bits), acc, s16, s32, sums, dsc, msc, pairs)
        _store(acc, y, t, n)
    return scratch.size  # (keeps the scratch alive past its last use through pointers)


@njit(cache=True)
def _int_scratch(kind, T, k):
    """int_range's scratch arrays cut from one allocation (eight allocations cost more than a small
    decode range's compute); the general kernels' arrays are empty where the fused row kernels
    (matmul_row) take all T rows."""
    nb, rc, big = k // 32, min(T, mi.ROW_CHUNK), T > mr.fused_limit(kind)
    n16, n32 = 4 * rc * (nb if big else 0) * R, (nb if big else 2) * R
    # per-block float scales: the legacy nibble kinds' tile path only (K kinds scale per superblock)
    nsc = (nb if big and kind != Q4_K and kind != Q5_K else 0) * R
    nsums = mi.sums_len(kind == Q6_K, rc, nb) if big else 0
    sizes = (4 * T * R, 2 * n16, 4 * n32, 4 * nsums, 4 * nsc, 4 * nsc, max(PAIRS_BYTES, mr.SUPER_BYTES))
    at = np.zeros(len(sizes) + 1, np.int64)  # each part's offset, 64-byte aligned
    for i in range(len(sizes)):
        at[i + 1] = at[i] + (sizes[i] + 63) // 64 * 64
    scratch = np.empty(at[-1] + 64, np.uint8)
    at += (scratch.ctypes.data + 63) // 64 * 64
    sc = (nsc // R, R)
    return carray(ptr_f32(at[0]), (T, R)), carray(ptr_i16(at[1]), (4, rc, nb if big else 0, R)), \
        carray(ptr_i32(at[2]), (nb if big else 2, R)), carray(ptr_i32(at[3]), (nsums,)), \
        carray(ptr_f32(at[4]), sc), carray(ptr_f32(at[5]), sc), carray(ptr_u8(at[6]), (sizes[6],)), \
        scratch  # fmt: skip


@njit(cache=True)
def int16_range(kind, argv, lo, hi) -> None:
    """Q8_0 weights times int16 activations (A_X8 / A_DX hold quantize_rows16's arrays)."""
    buf, n, k, T = _buf(argv), argv[A_N], argv[A_K], argv[A_T]
    x16 = carray(ptr_i16(argv[A_X8]), (T, k))
    dx = carray(ptr_f32(argv[A_DX]), (T, k // 32))
    y = carray(ptr_f32(argv[A_Y]), (T, argv[A_LDY]))
    acc = np.empty((T, R), np.float32)
    s32 = np.empty((k // 32, R), np.int32)
    d, q8 = _q8_fields(buf, n, k)
    for t in range(lo, hi):
        acc[:] = 0.0
        if not mr.fused_q8_0(d[t], q8[t], x16, dx, acc, s32[0]):
            mi.tile_q8_0(d[t], q8[t], x16, dx, acc, s32)
        _store(acc, y, t, n)


@njit(cache=True)
def float_range(kind, argv, lo, hi) -> None:
    """Float path over tiles lo..hi: dequantize each tile once, GEMM with all T rows.  With ids set
    (argv[A_IDS] != 0) it is the embedding lookup instead: rows ids[lo..hi] of W into y (T, k)."""
    buf, n, k, T = _buf(argv), argv[A_N], argv[A_K], argv[A_T]
    if argv[A_IDS] != 0:
        ids = carray(ptr_i64(argv[A_IDS]), (T,))
        y = carray(ptr_f32(argv[A_Y]), (T, k))
        for i in range(lo, hi):
            t, lane = ids[i] // R, ids[i] % R
            deq_tile(kind, buf, n, k, t, lane, lane + 1, y[i : i + 1])
        return
    w = np.empty((FLOAT_ROWS, k), np.float32)
    gemm_argv = np.zeros(GEMM_ARGV_LEN, np.int64)
    for t in range(lo, hi):
        rows = min(R, n - t * R)
        for r0 in range(0, rows, FLOAT_ROWS):
            r1 = min(rows, r0 + FLOAT_ROWS)
            deq_tile(kind, buf, n, k, t, r0, r1, w)
            y_addr, ldy = argv[A_Y], argv[A_LDY]
            call_gemm(argv[A_GEMM], gemm_argv, argv[A_X], T, k, w, r1 - r0, y_addr, ldy, t * R + r0)


@functools.cache
def range_kernel(kind: int, path: str):
    """The compiled C callback for (kind, path); kept alive here so its address stays valid.
    The closure captures only the int `kind`: Numba keys its disk cache on the pickled closure
    cells, and a captured dispatcher pickles differently in every process (a cache miss and a
    recompile per kernel at every start)."""
    if path == "int":

        def kernel(argv, lo, hi):
            int_range(kind, argv, lo, hi)

    elif path == "int16":

        def kernel(argv, lo, hi):
            int16_range(kind, argv, lo, hi)

    else:

        def kernel(argv, lo, hi):
            float_range(kind, argv, lo, hi)

    return cfunc(RANGE_KERNEL_SIG, cache=True)(kernel)


# ---- launchers ---------------------------------------------------------------------------------


@njit(cache=True)
def _argv(buf_addr, nbytes, n, k, x, y, xq, gemm):
    argv = np.zeros(ARGV_LEN, np.int64)
    argv[A_BUF], argv[A_NBYTES], argv[A_N], argv[A_K] = buf_addr, nbytes, n, k
    argv[A_T], argv[A_X], argv[A_Y] = x.shape[0], x.ctypes.data, y.ctypes.data
    x8, dx, sx, hs, x8p = xq
    argv[A_X8], argv[A_DX] = x8.ctypes.data, dx.ctypes.data
    argv[A_SX], argv[A_HS], argv[A_X8P] = sx.ctypes.data, hs.ctypes.data, x8p.ctypes.data
    argv[A_GEMM], argv[A_LDY] = gemm, y.shape[1]
    return argv


@njit(cache=True)
def _quantized(x, rounding):
    """x's int8 activations in `rounding` (ROUND_*); none (0 rows) for ROUND_NONE."""
    return quantize_rows(x if rounding != ROUND_NONE else x[:0], rounding)


@njit(cache=True)
def table_rounding(table, quantize):
    """The rounding of a launch over table's weights: theirs where they agree, else Q8_0 (whose sums
    are exact for every kind); none without quantize (the float path)."""
    if not quantize:
        return ROUND_NONE
    found = ROUND_NONE
    for i in range(table.shape[0]):
        r = table[i, T_ROUND]  # (zero rows pad a layer's table to the widest layer's; float kinds: none)
        if r != ROUND_NONE and found != ROUND_NONE and r != found:
            return ROUND_Q8_0
        found = r if r != ROUND_NONE else found
    return found if found != ROUND_NONE else ROUND_Q8_0


@njit(cache=True)
def _alive(argv, xq):
    """A use of argv and the quantized activations after the kernels ran.  The kernels only see raw
    pointers, and Numba frees an array right after its last visible use: without this, the
    buffers could be freed (and reused) while the kernels still read them."""
    return argv[0] + xq[0].size + xq[4].size


@njit(cache=True, parallel=True, nogil=True)
def launch_linear(fn, gemm, rounding, buf_addr, nbytes, n, k, x, y, nth):
    """Run range kernel `fn` over all tiles on nth threads (quantizing x first, as `rounding` says, for
    the int path).
    The weight is passed by address: as an array argument, a read-only one (a memory-mapped F16
    file) would compile a second copy of every launcher."""
    xq = _quantized(x, rounding)
    argv = _argv(buf_addr, nbytes, n, k, x, y, xq, gemm)
    bounds, nth = _one_weight_pieces(nbytes, n, k, x.shape[0], nth)
    next_piece = np.zeros(1, np.int64)
    for _c in prange(nth):
        while True:
            p = fetch_add(next_piece.ctypes.data, 1)
            if p >= bounds.shape[0] - 1:
                break
            call_range_kernel(fn, argv.ctypes.data, bounds[p], bounds[p + 1])
    return _alive(argv, xq) + next_piece[0]


@njit(cache=True)
def _one_weight_pieces(nbytes, n, k, T, nth):
    """(piece bounds, threads) of a one-weight launch (kernels/pieces.py)."""
    table = np.array([[0, 0, nbytes, n, k]], np.int64)
    nth = max(1, min(nth, (n + R - 1) // R))
    return plan_pieces(table, nth, k // 32 * T)[1], nth


@njit(cache=True, nogil=True)
def launch_linear_serial(fn, gemm, rounding, buf_addr, nbytes, n, k, x, y):
    xq = _quantized(x, rounding)
    argv = _argv(buf_addr, nbytes, n, k, x, y, xq, gemm)
    call_range_kernel(fn, argv.ctypes.data, 0, (n + R - 1) // R)
    return _alive(argv, xq)


@njit(cache=True)
def _group_argvs(table, gemm, x, outs, xq):
    """One argv per weight of a group (table rows: fn, buf address, nbytes, n, k; outs rows: output
    address, output row length), and the first global tile of each weight (tiles[-1] = total)."""
    W = table.shape[0]
    argvs = np.zeros((W, ARGV_LEN), np.int64)
    tiles = np.zeros(W + 1, np.int64)
    for i in range(W):
        argvs[i] = _argv(table[i, 1], table[i, 2], table[i, 3], table[i, 4], x, x, xq, gemm)
        argvs[i, A_Y], argvs[i, A_LDY] = outs[i, 0], outs[i, 1]
        tiles[i + 1] = tiles[i] + (table[i, 3] + R - 1) // R
    return argvs, tiles


@njit(cache=True, parallel=True, nogil=True)
def launch_many(table, gemm, quantize, x, outs, nth):
    """Several weights sharing the input x in one parallel launch (e.g. q/k/v, or gate/up): their
    tiles form one range, taken by the threads a piece at a time (kernels/pieces.py), and x is
    quantized once.  Weight i runs its own range kernel table[i, 0] and writes its (T, n_i) result
    at address outs[i, 0], rows outs[i, 1] floats apart: its own C-contiguous array, or a column
    range of a shared one."""
    xq = _quantized(x, table_rounding(table, quantize))
    argvs, tiles = _group_argvs(table, gemm, x, outs, xq)
    nth = max(1, min(nth, tiles[-1]))
    bounds = plan_pieces(table, nth, x.shape[1] // 32 * x.shape[0])[1]
    next_piece = np.zeros(1, np.int64)
    for _c in prange(nth):
        while True:
            p = fetch_add(next_piece.ctypes.data, 1)
            if p >= bounds.shape[0] - 1:
                break
            run_piece(table, argvs, tiles, bounds[p], bounds[p + 1])
    return _alive(argvs, xq) + next_piece[0]


@njit(cache=True)
def run_piece(table, argvs, tiles, lo, hi) -> None:
    """Global tiles lo..hi of a launch over several weights (each weight's part by its own kernel)."""
    for i in range(table.shape[0]):
        a, b = max(lo, tiles[i]), min(hi, tiles[i + 1])
        if a < b:
            call_range_kernel(table[i, 0], argvs[i].ctypes.data, a - tiles[i], b - tiles[i])


@njit(cache=True, nogil=True)
def _argv16(buf_addr, nbytes, n, k, x, y, x16, dx):
    argv = _argv(buf_addr, nbytes, n, k, x, y, quantize_rows(x[:0], ROUND_Q8_0), 0)
    argv[A_X8], argv[A_DX] = x16.ctypes.data, dx.ctypes.data
    return argv


@njit(cache=True, parallel=True, nogil=True)
def launch_linear16(fn, buf_addr, nbytes, n, k, x, y, nth):
    """launch_linear for the int16-activation kernel (Q8_0 only; see linear_precise), tiles shared out
    in pieces as there: with a static split, a thread that another process held off its core made the
    whole projection (Gemma 3's output: ~178 MB) wait for it."""
    x16, dx = quantize_rows16(x)
    argv = _argv16(buf_addr, nbytes, n, k, x, y, x16, dx)
    bounds, nth = _one_weight_pieces(nbytes, n, k, x.shape[0], nth)
    next_piece = np.zeros(1, np.int64)
    for _c in prange(nth):
        while True:
            p = fetch_add(next_piece.ctypes.data, 1)
            if p >= bounds.shape[0] - 1:
                break
            call_range_kernel(fn, argv.ctypes.data, bounds[p], bounds[p + 1])
    return argv[0] + x16.size + dx.size + next_piece[0]


@njit(cache=True, nogil=True)
def launch_linear16_serial(fn, buf_addr, nbytes, n, k, x, y):
    """launch_linear16 on the calling thread: a parallel launch of one thread can hand all of the work
    to another of Numba's threads (a thread's own team is its set_num_threads, by default every core)."""
    x16, dx = quantize_rows16(x)
    argv = _argv16(buf_addr, nbytes, n, k, x, y, x16, dx)
    call_range_kernel(fn, argv.ctypes.data, 0, (n + R - 1) // R)
    return argv[0] + x16.size + dx.size


@njit(cache=True, nogil=True)
def launch_two_pass(fn, rounding, buf_addr, nbytes, n, k, x, nth):
    """x @ W.T in two 8-bit passes, x and its rounding residual, as one launch of 2T rows (each weight
    tile read once for both); returns their (T, n) sum: the whole pair, which launch_refined's refined
    tiles equal bit for bit (the tests' reference; see linear_precise)."""
    T = x.shape[0]
    x2 = np.empty((2 * T, k), np.float32)
    with_residual(x, x2, rounding)
    y2 = np.empty((2 * T, n), np.float32)
    if nth <= 1 or nbytes * 2 * T < PARALLEL_MIN_WORK:
        launch_linear_serial(fn, 0, rounding, buf_addr, nbytes, n, k, x2, y2)
    else:
        launch_linear(fn, 0, rounding, buf_addr, nbytes, n, k, x2, y2, nth)
    return y2[:T] + y2[T:]


@njit(cache=True, nogil=True)
def launch_refined(fn, rounding, buf_addr, nbytes, n, k, x, nth):
    """x @ W.T nearly as if x stayed float32 where it matters (linear_precise): one 8-bit pass over every
    row, then x's rounding residual through a second 8-bit pass over the tiles refine.mark_tiles picks
    for each row, added there (the same float sum the two passes always made)."""
    T, tiles = x.shape[0], (n + R - 1) // R
    y = np.empty((T, n), np.float32)
    if nth <= 1 or nbytes * T < PARALLEL_MIN_WORK:
        launch_linear_serial(fn, 0, rounding, buf_addr, nbytes, n, k, x, y)
    else:
        launch_linear(fn, 0, rounding, buf_addr, nbytes, n, k, x, y, nth)
    own = np.zeros((T, tiles), np.bool_)
    for t in range(T):
        mark_tiles(y[t], own[t])
    union = np.nonzero(own.sum(axis=0))[0]  # each tile read once for every row that refines it
    x2 = np.empty((2 * T, k), np.float32)
    with_residual(x, x2, rounding)
    y1 = np.zeros((T, n), np.float32)
    launch_tiles(
        fn, rounding, buf_addr, nbytes, n, k, x2[T:], y1, union, nth if nbytes * T >= PARALLEL_MIN_WORK else 1
    )
    for t in range(T):
        for tile in union:
            if own[t, tile]:
                for i in range(tile * R, min(n, tile * R + R)):
                    y[t, i] += y1[t, i]
    return y


@njit(cache=True, parallel=True, nogil=True)
def _launch_tiles_parallel(fn, argv, tiles, nth):
    next_tile = np.zeros(1, np.int64)
    for _c in prange(nth):
        while True:
            p = fetch_add(next_tile.ctypes.data, 1)
            if p >= tiles.shape[0]:
                break
            call_range_kernel(fn, argv.ctypes.data, tiles[p], tiles[p] + 1)
    return next_tile[0]


@njit(cache=True, nogil=True)
def launch_tiles(fn, rounding, buf_addr, nbytes, n, k, x, y, tiles, nth):
    """Integer range kernel `fn` over the listed tiles only (y's other rows are left as they were), on
    nth threads (the calling one alone for nth <= 1: see launch_linear16_serial)."""
    xq = _quantized(x, rounding)
    argv = _argv(buf_addr, nbytes, n, k, x, y, xq, 0)
    if nth <= 1 or tiles.shape[0] < 2:
        for tile in tiles:
            call_range_kernel(fn, argv.ctypes.data, tile, tile + 1)
        return _alive(argv, xq)
    fetched = _launch_tiles_parallel(fn, argv, tiles, min(nth, tiles.shape[0]))
    return _alive(argv, xq) + fetched  # after the kernels: see _alive


@njit(cache=True, nogil=True)
def launch_embed(fn, buf_addr, nbytes, n, k, ids, y):
    xq = quantize_rows(y[:0], ROUND_Q8_0)
    argv = _argv(buf_addr, nbytes, n, k, y, y, xq, 0)
    argv[A_T], argv[A_IDS] = ids.shape[0], ids.ctypes.data
    call_range_kernel(fn, argv.ctypes.data, 0, ids.shape[0])
    return _alive(argv, xq)


# ---- Python entry points ----------------------------------------------------------------------


class KernelAddresses:
    """A weight's (int path, float path) range-kernel addresses (int is 0 for row kinds), each
    compiled or loaded from Numba's cache on first use: loading one adds to start-up, and
    with AVX2 a quantized matrix never takes the float path (only its embedding rows do)."""

    __slots__ = ("kind", "lane")

    def __init__(self, kind: int, lane: bool):
        self.kind, self.lane = kind, lane

    def __getitem__(self, i: int) -> int:
        if i == 0:
            return range_kernel(self.kind, "int").address if self.lane else 0
        if i == 1:
            return range_kernel(self.kind, "float").address
        raise IndexError(i)

    def __iter__(self):
        return iter((self[0], self[1]))

    def __len__(self) -> int:
        return 2


def prepare_weight(
    raw: np.ndarray, ggml_type: int, pack: Callable[[np.ndarray, int], PackedWeight] = pack_weight
) -> PackedWeight:
    """Repack a GGUF matrix for these kernels and compile (or load from cache) its kernels.
    pack: pack_weight or a stand-in with its signature (the backend's disk cache of packed weights)."""
    w = pack(raw, ggml_type)
    kernels = KernelAddresses(w.kind, w.lane)
    return dataclasses.replace(w, kernels=kernels, addr=w.buf.ctypes.data)


def linear(x: np.ndarray, w: PackedWeight, nth: int, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, K) float32 C-contiguous -> (T, N) float32, on nth threads."""
    t = x.shape[0]
    y = np.empty((t, w.n), np.float32) if out is None else out
    if x.ndim != 2 or x.shape[1] != w.k or y.shape != (t, w.n) or not y.flags.c_contiguous:
        raise ValueError(f"linear: x {x.shape} and out {y.shape} do not fit a ({w.n}, {w.k}) weight")
    use_int = w.lane and t <= INT_PATH_MAX_T
    fn = w.kernels[0] if use_int else w.kernels[1]
    gemm = 0 if use_int else w.gemm  # the integer path never calls the GEMM
    rounding = rounding_of(w.kind) if use_int else ROUND_NONE  # (use_int: a lane kind)
    if nth <= 1 or (use_int and w.nbytes * t < PARALLEL_MIN_WORK):
        launch_linear_serial(fn, gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y)
    else:
        launch_linear(fn, gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y, nth)
    return y


def linear_precise(x: np.ndarray, w: PackedWeight, nth: int) -> np.ndarray | None:
    """x @ W.T nearly as if x stayed float32: 16-bit activations in one pass for Q8_0 weights; for the
    other integer-path kinds x in one 8-bit pass, and its 8-bit rounding residual (whose own error is
    1/127 as large) in a second over the tiles of each row's highest outputs (launch_refined: the whole
    pair, launch_two_pass, cost a 1-thread decode up to 12% more of its output projection, even where
    VNNI's two-row register form shares the unpacking); None where the weight takes the float path."""
    if x.ndim != 2 or x.shape[1] != w.k or not x.flags.c_contiguous or x.dtype != np.float32:
        raise ValueError(f"linear_precise: x {x.shape} does not fit a ({w.n}, {w.k}) weight")
    if w.kind == Q8_0:
        y = np.empty((x.shape[0], w.n), np.float32)
        fn = range_kernel(Q8_0, "int16").address
        if nth <= 1 or w.nbytes * x.shape[0] < PARALLEL_MIN_WORK:  # as linear
            launch_linear16_serial(fn, w.addr, w.nbytes, w.n, w.k, x, y)
        else:
            launch_linear16(fn, w.addr, w.nbytes, w.n, w.k, x, y, nth)
        return y
    if not (w.lane and 2 * x.shape[0] <= INT_PATH_MAX_T):
        return None
    rounding = int(precise_rounding(rounding_of(w.kind)))
    return launch_refined(w.kernels[0], rounding, w.addr, w.nbytes, w.n, w.k, x, nth)


@dataclasses.dataclass(frozen=True, eq=False)
class WeightGroup:
    """Weights that multiply the same input, run as one launch (see launch_many)."""

    weights: tuple[PackedWeight, ...]
    offsets: tuple[int, ...]  # first output column of each weight
    n_total: int
    any_int: bool

    @classmethod
    def of(cls, weights: tuple[PackedWeight, ...]) -> WeightGroup:
        if len({w.k for w in weights}) != 1:
            raise ValueError("grouped weights must share the input size")
        offsets = tuple(int(o) for o in np.cumsum([0] + [w.n for w in weights[:-1]]))
        return cls(weights, offsets, sum(w.n for w in weights), any(w.lane for w in weights))

    _tables: dict = dataclasses.field(default_factory=dict)

    def table(self, use_int: bool) -> np.ndarray:
        """The launch table of one path (integer where allowed, or float), built on first use."""
        if use_int not in self._tables:
            self._tables[use_int] = group_table(self.weights, use_int)
        return self._tables[use_int]


def group_table(weights: Sequence[PackedWeight], use_int: bool) -> np.ndarray:
    """launch_many's table: (range kernel, buffer address, bytes, n, k, activation rounding) per weight
    (T_* columns)."""
    rows = []
    for w in weights:
        fn = w.kernels[0] if (use_int and w.lane) else w.kernels[1]
        rows.append((fn, w.addr, w.nbytes, w.n, w.k, rounding_of(w.kind)))
    return np.array(rows, np.int64).reshape(len(rows), TABLE_LEN)


def needs_gemm(weights: Sequence[PackedWeight], use_int: bool) -> bool:
    """Whether a launch over these weights can reach the float GEMM (float path, or a row kind)."""
    return not use_int or not all(w.lane for w in weights)


def linear_group(x: np.ndarray, group: WeightGroup, nth: int) -> list[np.ndarray]:
    """[x @ W.T for W in group] from one launch; the results are column views of one array."""
    t = x.shape[0]
    if x.ndim != 2 or x.shape[1] != group.weights[0].k:
        raise ValueError(f"linear_group: x {x.shape} does not fit weights of {group.weights[0].k} columns")
    y = np.empty((t, group.n_total), np.float32)
    use_int = group.any_int and t <= INT_PATH_MAX_T
    gemm = group.weights[0].gemm if needs_gemm(group.weights, use_int) else 0
    outs = np.array([(y.ctypes.data + 4 * o, group.n_total) for o in group.offsets], np.int64)
    launch_many(group.table(use_int), gemm, use_int, x, outs, max(1, nth))
    return [y[:, o : o + w.n] for w, o in zip(group.weights, group.offsets, strict=True)]


def _id_range(ids: np.ndarray) -> tuple[int, int]:
    """(min, max) of the ids, (0, 0) for none: a decode step's few by Python's min/max of a list, which
    beat two NumPy reductions (~3 us)."""
    if ids.size > 64:
        return int(ids.min()), int(ids.max())
    v = ids.ravel().tolist()
    return (min(v), max(v)) if v else (0, 0)


def embedding(w: PackedWeight, ids: np.ndarray) -> np.ndarray:
    """Rows ids of W, dequantized -> (len(ids), k) float32."""
    lo, hi = _id_range(ids)
    if lo < 0 or hi >= w.n:
        raise IndexError(f"token id out of range 0..{w.n - 1}")
    out = np.empty((ids.shape[0], w.k), np.float32)
    if not (ids.dtype == np.int64 and ids.flags.c_contiguous and ids.flags.writeable):
        ids = np.require(ids, np.int64, ["C", "W"])  # (~3 us a call even where nothing changes)
    launch_embed(w.kernels[1], w.addr, w.nbytes, w.n, w.k, ids, out)
    return out
