"""Paged, causal, grouped-query attention for a mixed batch of prefill chunks and decodes.

Same semantics as reference.paged_attention.  A work item is (sequence, query head, chunk of up
to QUERY_CHUNK consecutive queries): it streams the keys the chunk can see block by block through
the sequence's block table, and for every block computes the chunk's scores, updates an online
softmax per query (running max, running sum, rescaled accumulator) and adds the block's values.
Memory stays O(chunk x head_dim) however long the context, and each key/value row is loaded once
per chunk instead of once per query.  Items are dealt to threads round-robin, which balances
causal prefill (later chunks see more keys).
fastmath is safe: dot products are reordered, and exp is simd.fast_exp (~2 ulp).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import f32, fast_exp

QUERY_CHUNK = 16
# "Minus infinity" for the running max.  A finite value, because fastmath lets LLVM assume no infs.
_NEG_BIG = f32(-3.0e38)


@njit(cache=True)
def work_items(query_start_loc, context_lens, n_heads):
    """(sequence, head, first query, query count) for every chunk of every sequence and head."""
    count = 0
    for s in range(context_lens.shape[0]):
        nq = query_start_loc[s + 1] - query_start_loc[s]
        count += (nq + QUERY_CHUNK - 1) // QUERY_CHUNK * n_heads
    items = np.empty((count, 4), np.int64)
    i = 0
    for s in range(context_lens.shape[0]):
        for c0 in range(query_start_loc[s], query_start_loc[s + 1], QUERY_CHUNK):
            for h in range(n_heads):
                items[i, 0], items[i, 1], items[i, 2] = s, h, c0
                items[i, 3] = min(QUERY_CHUNK, query_start_loc[s + 1] - c0)
                i += 1
    return items


@njit(cache=True, fastmath=True, error_model="numpy")
def _block_scores(qc, nq, keys, row0, stride, n, sc) -> None:
    """sc[r, j] = qc[r] . keys[row0 + j * stride] (qc is pre-scaled)."""
    for j in range(n):
        for r in range(nq):
            s = f32(0.0)
            for d in range(qc.shape[1]):
                s += qc[r, d] * keys[row0 + j * stride, d]
            sc[r, j] = s


@njit(cache=True, fastmath=True, error_model="numpy")
def _softmax_update(sc, r, n, p, lo, hi, m, total, acc) -> None:
    """Row r: mask keys outside [lo, hi), fold the block into the running max/sum, leave exp(s - m)
    in sc[r, :n] (0 where masked) and rescale acc[r] if the max grew."""
    mx = m[r]
    for j in range(n):
        if p + j < lo or p + j >= hi:
            sc[r, j] = _NEG_BIG
        mx = max(mx, sc[r, j])
    if mx == _NEG_BIG:  # nothing visible in this block
        for j in range(n):
            sc[r, j] = 0.0
        return
    c = fast_exp(m[r] - mx)
    s = f32(0.0)
    for j in range(n):
        e = fast_exp(sc[r, j] - mx) if sc[r, j] > _NEG_BIG else f32(0.0)
        sc[r, j] = e
        s += e
    total[r] = total[r] * c + s
    m[r] = mx
    for d in range(acc.shape[1]):
        acc[r, d] *= c


@njit(cache=True, fastmath=True, error_model="numpy")
def _add_values(sc, nq, values, row0, stride, n, acc) -> None:
    """acc[r] += sum_j sc[r, j] * values[row0 + j * stride]."""
    for j in range(n):
        for r in range(nq):
            w = sc[r, j]
            for d in range(acc.shape[1]):
                acc[r, d] += w * values[row0 + j * stride, d]


@njit(cache=True, fastmath=True, error_model="numpy")
def attend_chunk(q, keys, values, bs, kvh, table, h, i0, nq, pos0, scale, window, out, scratch) -> None:
    """Queries i0 .. i0+nq-1 of head h (positions pos0 ..) against their visible keys.  keys/values
    are the cache as (blocks * block_size * kv_heads, D) rows (plain 2-D indexing vectorises
    reliably; 4-D indexing did not).  One loop over cache blocks; split further, the running
    state would go through memory."""
    qc, sc, acc, m, total = scratch
    kh = h // (q.shape[1] // kvh)
    for r in range(nq):
        m[r], total[r] = _NEG_BIG, f32(0.0)
        for d in range(q.shape[2]):
            qc[r, d] = q[i0 + r, h, d] * scale
            acc[r, d] = 0.0
    first = max(0, pos0 - window + 1) if window > 0 else 0
    end = pos0 + nq  # one past the last query's position
    # Whole blocks only, the rest masked: how a query's sums are grouped must not depend on which
    # chunk it shares (chunked prefill, batching), or batched and lone runs would differ in the last
    # bits. Masked slots add exact zeros; unwritten cache slots hold zeros or older finite values.
    p = first - first % bs
    while p < end:
        row0 = table[p // bs] * bs * kvh + kh
        _block_scores(qc, nq, keys, row0, kvh, bs, sc)
        for r in range(nq):
            lo = max(0, pos0 + r - window + 1) if window > 0 else 0
            _softmax_update(sc, r, bs, p, lo, pos0 + r + 1, m, total, acc)
        _add_values(sc, nq, values, row0, kvh, bs, acc)
        p += bs
    for r in range(nq):
        inv = f32(1.0) / total[r] if total[r] > f32(0.0) else f32(0.0)
        for d in range(q.shape[2]):
            out[i0 + r, h, d] = acc[r, d] * inv


@njit(cache=True, fastmath=True, error_model="numpy")
def attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, items, out, first, step) -> None:
    """Items first, first + step, ... of `items` (see work_items)."""
    D, bs, kvh = q.shape[2], k_cache.shape[1], k_cache.shape[2]
    keys, values = k_cache.reshape(-1, D), v_cache.reshape(-1, D)
    scratch = (
        np.empty((QUERY_CHUNK, D), np.float32),
        np.empty((QUERY_CHUNK, bs), np.float32),
        np.empty((QUERY_CHUNK, D), np.float32),
        np.empty(QUERY_CHUNK, np.float32),
        np.empty(QUERY_CHUNK, np.float32),
    )
    for it in range(first, items.shape[0], step):
        s, h, i0, nq = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        pos0 = ctx[s] - (qsl[s + 1] - qsl[s]) + (i0 - qsl[s])  # position of query i0
        attend_chunk(q, keys, values, bs, kvh, tables[s], h, i0, nq, pos0, f32(scale), window, out, scratch)


@njit(cache=True, parallel=True)
def paged_attention_par(q, k_cache, v_cache, qsl, ctx, tables, scale, window, out, nth) -> None:
    items = work_items(qsl, ctx, q.shape[1])
    for c in prange(nth):
        attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, items, out, c, nth)


@njit(cache=True)
def paged_attention_serial(q, k_cache, v_cache, qsl, ctx, tables, scale, window, out) -> None:
    items = work_items(qsl, ctx, q.shape[1])
    attend_items(q, k_cache, v_cache, qsl, ctx, tables, scale, window, items, out, 0, 1)
