"""Paged, causal, grouped-query attention for a mixed batch of prefill chunks and decodes.

Same semantics as reference.paged_attention.  A work item is (sequence, KV head, chunk of
consecutive queries): its rows are every (query, query head) sharing that KV head, so each key
and value row read from the cache serves the whole group (3-7 heads in the models we run).  Per
item, in three passes over the keys the chunk can see (through the block table):
  1. scores of every row against its visible keys, into a scratch of (rows, visible keys);
  2. per row: max, exp, sum (a numerically stable softmax, vectorised along the keys);
  3. per row: the probability-weighted sum of the value rows.
Memory is O(rows x context), linear in the context.  A row's arithmetic depends only on its
query and its visible keys, in key order (its scratch row starts at its own first visible key),
never on which chunk or batch it came in: lone and batched decodes give the same bits.
Items are dealt to threads round-robin, which balances causal prefill (later chunks see more keys).
fastmath is safe: dot products are reordered, and exp is simd.fast_exp (~2 ulp).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import attention_q8 as q8
from .kv import kv_get, kv_row
from .kv_rotation import fwht, key_rotation, value_rotation
from .simd import f32, fast_exp

ROWS_PER_ITEM = 16  # (query, head) rows per work item: queries per chunk = 16 // group size


@njit(cache=True)
def queries_per_item(n_heads, n_kv_heads):
    return max(1, ROWS_PER_ITEM // (n_heads // n_kv_heads))


@njit(cache=True)
def work_items(query_start_loc, context_lens, n_kv_heads, qpi):
    """(sequence, kv head, first query, query count) for every chunk of qpi queries."""
    count = 0
    for s in range(context_lens.shape[0]):
        nq = query_start_loc[s + 1] - query_start_loc[s]
        count += (nq + qpi - 1) // qpi * n_kv_heads
    items = np.empty((count, 4), np.int64)
    i = 0
    for s in range(context_lens.shape[0]):
        for c0 in range(query_start_loc[s], query_start_loc[s + 1], qpi):
            for h in range(n_kv_heads):
                items[i, 0], items[i, 1], items[i, 2] = s, h, c0
                items[i, 3] = min(qpi, query_start_loc[s + 1] - c0)
                i += 1
    return items


@njit(inline="always")
def _first_visible(pos, window):
    return max(0, pos - window + 1) if window > 0 else 0


@njit(cache=True)
def _row_bounds(rows, group, pos0, window, lo, hi) -> None:
    """Keys lo[row] <= j < hi[row] are visible to a row (divisions out of the inner loops: an
    int64 division costs ~40 cycles, more than a row's dot product with one key)."""
    for row in range(rows):
        pos = pos0 + row // group
        lo[row] = _first_visible(pos, window)
        hi[row] = pos + 1


@njit(cache=True, fastmath=True, error_model="numpy")
def _scores(qc, rows, keys, table, bs, kvh, kh, lo, hi, softcap, sc, buf) -> None:
    """sc[row, j - lo[row]] = qc[row] . key j for every key j the row sees (soft-capped when
    softcap > 0: softcap * tanh(score / softcap), as gemma2 does). buf: a q8_0 key's row, dequantized
    once for every row of the group."""
    first, end = lo[0], hi[rows - 1]
    for b in range(first // bs, (end - 1) // bs + 1):
        j0, j1 = max(first, b * bs), min(end, b * bs + bs)
        kr0 = (table[b] * bs - b * bs) * kvh + kh  # cache row of key j: kr0 + j * kvh
        for j in range(j0, j1):
            key = kv_row(keys, kr0 + j * kvh, buf)
            for row in range(rows):
                if j < lo[row] or j >= hi[row]:
                    continue
                s = f32(0.0)
                for d in range(qc.shape[1]):
                    s += qc[row, d] * kv_get(key, d)
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                sc[row, j - lo[row]] = s


@njit(cache=True, fastmath=True, error_model="numpy")
def _softmax_rows(sc, rows, lo, hi, total, sink) -> None:
    """Each row's visible scores -> exp(s - max), and their sum in total[row].  sink: per row, an
    attention-sink logit (gpt-oss) that joins the max and the sum without a value; empty: none."""
    for row in range(rows):
        n = hi[row] - lo[row]
        mx = sc[row, 0]
        for j in range(n):
            mx = max(mx, sc[row, j])
        if sink.size:
            mx = max(mx, sink[row])
        t = f32(0.0)
        for j in range(n):
            e = fast_exp(sc[row, j] - mx)
            sc[row, j] = e
            t += e
        total[row] = t + (fast_exp(sink[row] - mx) if sink.size else f32(0.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def _weighted_values(sc, rows, values, table, bs, kvh, kh, lo, hi, acc, buf) -> None:
    """acc[row] = sum over the row's visible keys j (ascending) of sc[row, j] * value j."""
    acc[:rows] = 0.0
    first, end = lo[0], hi[rows - 1]
    for b in range(first // bs, (end - 1) // bs + 1):
        j0, j1 = max(first, b * bs), min(end, b * bs + bs)
        vr0 = (table[b] * bs - b * bs) * kvh + kh
        for j in range(j0, j1):
            value = kv_row(values, vr0 + j * kvh, buf)
            for row in range(rows):
                if j < lo[row] or j >= hi[row]:
                    continue
                w = sc[row, j - lo[row]]
                for d in range(acc.shape[1]):
                    acc[row, d] += w * kv_get(value, d)


def _key_pass(q, i0, kh, scale, qc, rows, keys, table, bs, kvh, lo, hi, softcap, sc, scratch):
    """sc = the rows' scores: _scores over f32/f16 keys, attention_q8's integer dots over q8_0 keys."""


def _unrotate(values, out, i0, rows, group, kh):
    """Over a q8_0 value cache, the rows' outputs rotated back (kv_rotation.py); otherwise nothing."""


@overload(_unrotate, inline="always", jit_options={"cache": True})
def _unrotate_impl(values, out, i0, rows, group, kh):
    if not _is_q8(values):
        return lambda values, out, i0, rows, group, kh: None

    def rotate_back(values, out, i0, rows, group, kh):
        rot = value_rotation(out.shape[2])
        if rot > 0:
            for row in range(rows):
                fwht(out[i0 + row // group, kh * group + row % group], rot)

    return rotate_back


def _is_q8(cache) -> bool:
    return isinstance(cache, types.Array) and cache.dtype == types.int8


@overload(_key_pass, inline="always", jit_options={"cache": True})
def _key_pass_impl(q, i0, kh, scale, qc, rows, keys, table, bs, kvh, lo, hi, softcap, sc, scratch):
    if not _is_q8(keys):
        return lambda q, i0, kh, scale, qc, rows, keys, table, bs, kvh, lo, hi, softcap, sc, scratch: _scores(
            qc, rows, keys, table, bs, kvh, kh, lo, hi, softcap, sc, scratch[7]
        )

    def integer_dots(q, i0, kh, scale, qc, rows, keys, table, bs, kvh, lo, hi, softcap, sc, scratch):
        qq, qd, rotated = scratch[8], scratch[9], scratch[7]
        group = q.shape[1] // kvh
        rot = key_rotation(q.shape[2])
        for row in range(rows):  # once per query row and step, unscaled (as llama.cpp)
            x = q[i0 + row // group, kh * group + row % group]
            if rot > 0:  # the keys were stored rotated (kv_rotation.py)
                rotated[:] = x
                fwht(rotated, rot)
                x = rotated
            q8.quantize_query(x, qq[row], qd[row])
        kd = scratch[10]
        q8.scores_q8(qq, qd, rows, keys, table, bs, kvh, kh, lo, hi, scale, softcap, sc, kd)

    return integer_dots


@njit(cache=True, fastmath=True, error_model="numpy")
def attend_item(q, keys, values, bs, kvh, table, kh, i0, nq, pos0, scale, window, softcap, sinks, out,
                scratch):  # fmt: skip
    """Queries i0 .. i0+nq-1 (positions pos0 ..) of every query head of KV head kh.  keys/values
    are the cache as (blocks * block_size * kv_heads, width) rows (plain 2-D indexing vectorises
    reliably; 4-D indexing did not): width D, or a q8_0 row's bytes.  sinks: (n_heads,) sink logits,
    or empty."""
    qc, sc, acc, total, lo, hi, sink, buf = scratch[:8]
    group = q.shape[1] // kvh
    rows = nq * group
    _row_bounds(rows, group, pos0, window, lo, hi)
    for row in range(rows):
        h = kh * group + row % group
        for d in range(q.shape[2]):
            qc[row, d] = q[i0 + row // group, h, d] * scale
        if sinks.size:
            sink[row] = sinks[h]
    _key_pass(q, i0, kh, scale, qc, rows, keys, table, bs, kvh, lo, hi, softcap, sc, scratch)
    _softmax_rows(sc, rows, lo, hi, total, sink[:rows] if sinks.size else sink[:0])
    _weighted_values(sc, rows, values, table, bs, kvh, kh, lo, hi, acc, buf)
    for row in range(rows):
        h = kh * group + row % group
        inv = f32(1.0) / total[row]
        for d in range(q.shape[2]):
            out[i0 + row // group, h, d] = acc[row, d] * inv
    _unrotate(values, out, i0, rows, group, kh)


@njit(cache=True, fastmath=True, error_model="numpy")
def attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, sinks, items, out, first,
                 step):  # fmt: skip
    """Items first, first + step, ... of `items` (see work_items)."""
    D, bs, kvh = q.shape[2], k_cache.shape[1], k_cache.shape[2]
    keys, values = k_cache.reshape(-1, k_cache.shape[3]), v_cache.reshape(-1, v_cache.shape[3])
    rows = queries_per_item(q.shape[1], kvh) * (q.shape[1] // kvh)
    width = max(1, ctx.max() if ctx.size else 1)
    if window > 0:
        width = min(width, window)
    scratch = (
        np.empty((rows, D), np.float32),
        np.empty((rows, width), np.float32),
        np.empty((rows, D), np.float32),
        np.empty(rows, np.float32),
        np.empty(rows, np.int64),
        np.empty(rows, np.int64),
        np.empty(rows, np.float32),
        np.empty(D, np.float32),
        np.empty((rows, D), np.int8),  # a q8_0 key cache's quantized queries and their scales
        np.empty((rows, max(1, D // 32)), np.float32),
        np.empty(max(1, D // 32), np.float32),  # a q8_0 key's block scales
    )
    for it in range(first, items.shape[0], step):
        s, kh, i0, nq = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        pos0 = ctx[s] - (qsl[s + 1] - qsl[s]) + (i0 - qsl[s])  # position of query i0
        cap = f32(softcap)
        attend_item(q, keys, values, bs, kvh, tables[s], kh, i0, nq, pos0, f32(scale), window, cap, sinks,
                    out, scratch)  # fmt: skip


@njit(cache=True, parallel=True, nogil=True)
def paged_attention_sinks_par(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, sinks, out,
                              nth) -> None:  # fmt: skip
    """paged_attention_par with attention sinks: sinks (n_heads,) float32 logits (empty: none)."""
    items = work_items(qsl, ctx, k_cache.shape[2], queries_per_item(q.shape[1], k_cache.shape[2]))
    for c in prange(nth):
        attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, sinks, items, out, c, nth)


@njit(cache=True, nogil=True)
def paged_attention_sinks_serial(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, sinks,
                                 out) -> None:  # fmt: skip
    items = work_items(qsl, ctx, k_cache.shape[2], queries_per_item(q.shape[1], k_cache.shape[2]))
    attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, sinks, items, out, 0, 1)


@njit(cache=True, nogil=True)
def paged_attention_par(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, out, nth) -> None:
    none = np.empty(0, np.float32)
    paged_attention_sinks_par(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, none, out, nth)


@njit(cache=True, nogil=True)
def paged_attention_serial(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, out) -> None:
    none = np.empty(0, np.float32)
    paged_attention_sinks_serial(q, k_cache, v_cache, qsl, ctx, tables, scale, window, softcap, none, out)
