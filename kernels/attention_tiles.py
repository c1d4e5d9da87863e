"""Attention's arithmetic on tiles of TILE keys: the scores of a work item's rows and their weighted sum
of values, near the FMA throughput (attention.py walks the tiles; this module does not know the cache).

Tiles are aligned to multiples of TILE in the sequence's key positions, and every tile is computed
whole (keys outside the item's range are zeros), so a row's arithmetic never depends on which other
rows share its work item: lone and batched decodes give the same bits.
  - Scores: a key tile is converted to float32 once, transposed to kt (D, TILE), and each row's TILE
    scores are one vector loop along the keys (no horizontal sum per dot product), eight dimensions
    per pass over the row's scores.
  - Values: a value tile is converted once to vt (TILE, D); each row adds eight weighted value rows per
    pass over its accumulator.  Masked keys weigh exactly 0, and fma(0, v, acc) is acc.
The hot loops index raw pointers: an array index checks for a negative index, and 2-D arrays have
run-time strides; either makes LLVM re-check aliasing for every eight rows it reads, which cost more
than the 64 multiply-adds in between.
"""

from __future__ import annotations

from numba import njit, types
from numba.extending import overload

from .kv import kv_row
from .simd import f16_to_f32, ptr_f32, ptr_u16

TILE = 64  # keys per tile: a multiple of 8; kt is 16 KiB at head size 64


def cache_ptr(cache):
    """A raw pointer to an f32 or f16 cache's first element (typed float32 or uint16)."""


@overload(cache_ptr, inline="always", jit_options={"cache": True})
def _cache_ptr_impl(cache):
    if cache.dtype == types.uint16:
        return lambda cache: ptr_u16(cache.ctypes.data)
    return lambda cache: ptr_f32(cache.ctypes.data)


def as_f32(x):
    """An f32 or f16 (uint16 bits) cache element as float32."""


@overload(as_f32, inline="always", jit_options={"cache": True})
def _as_f32_impl(x):
    if x == types.uint16:
        return lambda x: f16_to_f32(x)
    return lambda x: x


@njit(cache=True, fastmath=True, error_model="numpy")
def key_tile(keys, table, bs, kvh, kh, t0, j0, j1, kt, panel, rk) -> None:
    """kt[d, jj] = element d of key t0 + jj (f32 or f16 keys) as float32, for j0 <= t0 + jj < j1
    (other columns: a copy of key j0, whose scores no row reads).  keys: the cache as rows
    (attention.attend_item); panel (D * 8,), rk (TILE,): scratch."""
    w = keys.shape[1]
    for b in range(j0 // bs, (j1 - 1) // bs + 1):
        kr0 = (table[b] * bs - b * bs) * kvh + kh  # cache row of key j: kr0 + j * kvh
        for j in range(max(j0, b * bs), min(j1, b * bs + bs)):
            rk[j - t0] = (kr0 + j * kvh) * w
    rk[: j0 - t0] = rk[j0 - t0]
    rk[j1 - t0 :] = rk[j0 - t0]
    for g in range(0, TILE, 8):
        _transpose8(keys, rk, g, kt, panel)


@njit(cache=True, fastmath=True, error_model="numpy")
def _transpose8(keys, rk, g, kt, panel) -> None:
    """Keys g .. g+7 of the tile (their first elements at rk[g ..] in keys' flat storage) into
    columns g .. g+7 of kt: first as a (D, 8) panel, whose eight interleaved stores a step LLVM
    vectorises as one transpose, then eight floats a row; writing kt's columns directly was 7x slower."""
    src, p, k = cache_ptr(keys), ptr_f32(panel.ctypes.data), ptr_f32(kt.ctypes.data)
    r0, r1, r2, r3, r4, r5, r6, r7 = (
        rk[g],
        rk[g + 1],
        rk[g + 2],
        rk[g + 3],
        rk[g + 4],
        rk[g + 5],
        rk[g + 6],
        rk[g + 7],
    )
    for d in range(kt.shape[0]):
        e = d * 8
        p[e], p[e + 1], p[e + 2], p[e + 3] = (
            as_f32(src[r0 + d]),
            as_f32(src[r1 + d]),
            as_f32(src[r2 + d]),
            as_f32(src[r3 + d]),
        )
        p[e + 4], p[e + 5], p[e + 6], p[e + 7] = (
            as_f32(src[r4 + d]),
            as_f32(src[r5 + d]),
            as_f32(src[r6 + d]),
            as_f32(src[r7 + d]),
        )
    for d in range(kt.shape[0]):
        c, e = d * TILE + g, d * 8
        k[c], k[c + 1], k[c + 2], k[c + 3] = p[e], p[e + 1], p[e + 2], p[e + 3]
        k[c + 4], k[c + 5], k[c + 6], k[c + 7] = p[e + 4], p[e + 5], p[e + 6], p[e + 7]


def row_f32(cache, i, out, o, buf):
    """out[o : o + D] = row i of the cache rows as float32 (out: a float32 pointer; buf (D,): a q8_0
    row's scratch).  Through raw pointers: a row view costs two atomic reference counts."""


@overload(row_f32, inline="always", jit_options={"cache": True})
def _row_f32_impl(cache, i, out, o, buf):
    if cache.dtype == types.int8:

        def dequantized(cache, i, out, o, buf):
            row = kv_row(cache, i, buf)
            for d in range(buf.shape[0]):
                out[o + d] = row[d]

        return dequantized

    def converted(cache, i, out, o, buf):
        src, base = cache_ptr(cache), i * cache.shape[1]
        for d in range(buf.shape[0]):
            out[o + d] = as_f32(src[base + d])

    return converted


@njit(cache=True, fastmath=True, error_model="numpy")
def value_tile(values, table, bs, kvh, kh, t0, j0, j1, vt, buf) -> None:
    """vt[jj] = value t0 + jj as float32 for j0 <= t0 + jj < j1, 0 for the rest of the tile."""
    vt[: j0 - t0] = 0.0
    vt[j1 - t0 :] = 0.0
    v, D = ptr_f32(vt.ctypes.data), vt.shape[1]
    for b in range(j0 // bs, (j1 - 1) // bs + 1):
        vr0 = (table[b] * bs - b * bs) * kvh + kh
        for j in range(max(j0, b * bs), min(j1, b * bs + bs)):
            row_f32(values, vr0 + j * kvh, v, (j - t0) * D, buf)


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_scores(qc, rows, kt, st, off) -> None:
    """st[row, off[row] + jj] = qc[row] . kt[:, jj] for all TILE keys jj (kt, st C-contiguous)."""
    D, T = qc.shape[1], TILE
    k, s = ptr_f32(kt.ctypes.data), ptr_f32(st.ctypes.data)
    for row in range(rows):
        o = row * st.shape[1] + off[row]
        for jj in range(T):
            s[o + jj] = 0.0
        for d in range(0, D - D % 8, 8):
            q0, q1, q2, q3 = qc[row, d], qc[row, d + 1], qc[row, d + 2], qc[row, d + 3]
            q4, q5, q6, q7 = qc[row, d + 4], qc[row, d + 5], qc[row, d + 6], qc[row, d + 7]
            c = d * T
            for jj in range(T):
                s[o + jj] += (
                    q0 * k[c + jj] + q1 * k[c + T + jj] + q2 * k[c + 2 * T + jj] + q3 * k[c + 3 * T + jj]
                    + q4 * k[c + 4 * T + jj] + q5 * k[c + 5 * T + jj] + q6 * k[c + 6 * T + jj]
                    + q7 * k[c + 7 * T + jj]
                )  # fmt: skip
        for d in range(D - D % 8, D):
            qd = qc[row, d]
            for jj in range(T):
                s[o + jj] += qd * k[d * T + jj]


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_values(p, off, rows, vt, acc) -> None:
    """acc[row] += sum over the tile's keys jj of p[row, off[row] + jj] * vt[jj], eight keys at a time."""
    D, T = vt.shape[1], TILE
    v, a = ptr_f32(vt.ctypes.data), ptr_f32(acc.ctypes.data)
    for row in range(rows):
        o = row * D
        for j in range(0, T, 8):
            i = off[row] + j
            w0, w1, w2, w3 = p[row, i], p[row, i + 1], p[row, i + 2], p[row, i + 3]
            w4, w5, w6, w7 = p[row, i + 4], p[row, i + 5], p[row, i + 6], p[row, i + 7]
            c = j * D
            for d in range(D):
                a[o + d] += (
                    w0 * v[c + d] + w1 * v[c + D + d] + w2 * v[c + 2 * D + d] + w3 * v[c + 3 * D + d]
                    + w4 * v[c + 4 * D + d] + w5 * v[c + 5 * D + d] + w6 * v[c + 6 * D + d]
                    + w7 * v[c + 7 * D + d]
                )  # fmt: skip
