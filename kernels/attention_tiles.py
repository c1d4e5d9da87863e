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

from numba import njit

from .kv import kv_get, kv_row
from .simd import ptr_f32

TILE = 64  # keys per tile: a multiple of 8; kt is 16 KiB at head size 64


@njit(cache=True, fastmath=True, error_model="numpy")
def key_tile(keys, table, bs, kvh, kh, t0, j0, j1, kt, buf) -> None:
    """kt[d, jj] = element d of key t0 + jj as float32 for j0 <= t0 + jj < j1, 0 for the rest of
    the tile.  keys: the cache as rows (attention.attend_item); buf: a q8_0 row's scratch."""
    kt[:, : j0 - t0] = 0.0
    kt[:, j1 - t0 :] = 0.0
    for b in range(j0 // bs, (j1 - 1) // bs + 1):
        kr0 = (table[b] * bs - b * bs) * kvh + kh  # cache row of key j: kr0 + j * kvh
        for j in range(max(j0, b * bs), min(j1, b * bs + bs)):
            key = kv_row(keys, kr0 + j * kvh, buf)
            for d in range(kt.shape[0]):
                kt[d, j - t0] = kv_get(key, d)


@njit(cache=True, fastmath=True, error_model="numpy")
def value_tile(values, table, bs, kvh, kh, t0, j0, j1, vt, buf) -> None:
    """vt[jj] = value t0 + jj as float32 for j0 <= t0 + jj < j1, 0 for the rest of the tile."""
    vt[: j0 - t0] = 0.0
    vt[j1 - t0 :] = 0.0
    for b in range(j0 // bs, (j1 - 1) // bs + 1):
        vr0 = (table[b] * bs - b * bs) * kvh + kh
        for j in range(max(j0, b * bs), min(j1, b * bs + bs)):
            value = kv_row(values, vr0 + j * kvh, buf)
            for d in range(vt.shape[1]):
                vt[j - t0, d] = kv_get(value, d)


@njit(cache=True, fastmath=True, error_model="numpy")
def tile_scores(qc, rows, kt, st) -> None:
    """st[row, jj] = qc[row] . kt[:, jj] for all TILE keys (kt, st C-contiguous float32)."""
    D, T = qc.shape[1], TILE
    k, s = ptr_f32(kt.ctypes.data), ptr_f32(st.ctypes.data)
    for row in range(rows):
        o = row * T
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
def tile_values(p, rows, vt, acc) -> None:
    """acc[row] += sum over the tile's keys jj of p[row, jj] * vt[jj], eight keys at a time."""
    D, T = vt.shape[1], TILE
    v, a = ptr_f32(vt.ctypes.data), ptr_f32(acc.ctypes.data)
    for row in range(rows):
        o = row * D
        for j in range(0, T, 8):
            w0, w1, w2, w3 = p[row, j], p[row, j + 1], p[row, j + 2], p[row, j + 3]
            w4, w5, w6, w7 = p[row, j + 4], p[row, j + 5], p[row, j + 6], p[row, j + 7]
            c = j * D
            for d in range(D):
                a[o + d] += (
                    w0 * v[c + d] + w1 * v[c + D + d] + w2 * v[c + 2 * D + d] + w3 * v[c + 3 * D + d]
                    + w4 * v[c + 4 * D + d] + w5 * v[c + 5 * D + d] + w6 * v[c + 6 * D + d]
                    + w7 * v[c + 7 * D + d]
                )  # fmt: skip
