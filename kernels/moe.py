"""Mixture-of-experts FFN: route each token to its top-k experts and run only those experts' matrices.

Each expert's matrix is its own PackedWeight (WeightLoader.experts cuts the GGUF's (experts, rows, cols)
tensor), named by a launch-table row (range kernel, buffer address, bytes, n, k) as in
matmul.launch_many. A step's tokens are grouped by expert: the rows of h routed to an expert are
gathered into one block, so each routed expert's weights are read once for all its tokens (a prefill)
and an expert no token chose is never read. All routed experts' gate and up tiles are split over the
threads in one launch, their down tiles in a second. kernels/moe_reference.py is the NumPy twin.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import matmul
from .layers import geglu_rows, swiglu_oai_rows, swiglu_rows
from .packing import TILE_ROWS as R
from .pieces import counter_pieces
from .simd import call_range_kernel, f32, fetch_add

# llama.cpp clamps the sum it renormalises the top-k weights by (the smallest normal float16)
RENORM_MIN = f32(6.103515625e-5)
STAT_BYTES, STAT_ROWS = 0, 1  # stats[]: expert-weight bytes launched, (token, layer) rows routed
ACT_SILU, ACT_OAI, ACT_GELU = 0, 1, 2  # the experts' activation: SwiGLU, gpt-oss's clamped one, GeGLU


@njit(cache=True, error_model="numpy")
def route(logits, k, renorm, ids, weights) -> None:
    """Per token: softmax over all experts, the k most probable (ties: lower index) into ids (T, k) in
    descending order and their probabilities into weights (T, k), renormalised to sum 1 if renorm."""
    T, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    for t in range(T):
        m = logits[t].max()
        s = f32(0.0)
        for e in range(E):
            p[e] = np.exp(logits[t, e] - m)
            s += p[e]
        taken[:] = False
        total = f32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = p[best] / s
            total += weights[t, j]
        if renorm:
            for j in range(k):
                weights[t, j] = weights[t, j] / max(total, RENORM_MIN)


@njit(cache=True)
def group_by_expert(ids, n_experts):
    """Rows of the (T * k) routed pairs in expert order: starts (E + 1,) where each expert's rows begin,
    order (T * k,) each row's token (ascending within an expert), slot (T, k) each pair's row."""
    T, k = ids.shape
    starts = np.zeros(n_experts + 1, np.int64)
    for t in range(T):
        for j in range(k):
            starts[ids[t, j] + 1] += 1
    for e in range(n_experts):
        starts[e + 1] += starts[e]
    fill = starts[:-1].copy()
    order = np.empty(T * k, np.int64)
    slot = np.empty((T, k), np.int64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            order[fill[e]] = t
            slot[t, j] = fill[e]
            fill[e] += 1
    return starts, order, slot


@njit(cache=True)
def _segment_argvs(table, rows, cols, gemm, x, y, xq):
    """launch_segments' argv per weight (its rows of x and y, from column cols[i] of y) and each
    weight's first tile (tiles[-1] = total)."""
    W, ldy = table.shape[0], y.shape[1]
    argvs = np.zeros((W, matmul.ARGV_LEN), np.int64)
    tiles = np.zeros(W + 1, np.int64)
    for i in range(W):
        a, b = rows[i, 0], rows[i, 1]
        part = (xq[0][a:b], xq[1][a:b], xq[2][a:b], xq[3][a:b], xq[4][a:b])
        fn_args = (table[i, 1], table[i, 2], table[i, 3], table[i, 4])
        argvs[i] = matmul._argv(*fn_args, x[a:b], y[a:b], part, gemm)
        argvs[i, matmul.A_Y] = y.ctypes.data + 4 * (a * ldy + cols[i])
        argvs[i, matmul.A_LDY] = ldy
        tiles[i + 1] = tiles[i] + (table[i, 3] + R - 1) // R
    return argvs, tiles


@njit(cache=True, parallel=True, nogil=True)
def launch_segments(table, rows, cols, gemm, quantize, x, y, nth):
    """Weight i of table (W, matmul.TABLE_LEN) multiplies rows rows[i, 0]:rows[i, 1] of x (quantized
    once for all, in the rounding its weights take) and writes those rows of y from column cols[i];
    every weight's tiles in one launch, taken by the threads a piece at a time as matmul.launch_many
    does (the experts' row counts differ, so equal shares of tiles were unequal work, and a thread
    another process held up kept its share). Each range kernel sees only its own weight's bytes."""
    xq = matmul._quantized(x, matmul.table_rounding(table, quantize))
    argvs, tiles = _segment_argvs(table, rows, cols, gemm, x, y, xq)
    W, total = table.shape[0], tiles[-1]
    nth = max(1, min(nth, total))
    mean_rows = max(1, (rows[:, 1] - rows[:, 0]).sum() // max(1, W))
    piece, next_tile = counter_pieces(total, nth, x.shape[1] // 32 * mean_rows)
    for _c in prange(nth):
        while True:
            lo = fetch_add(next_tile.ctypes.data, piece)
            if lo >= total:
                break
            hi = min(total, lo + piece)
            for i in range(W):
                a, b = max(lo, tiles[i]), min(hi, tiles[i + 1])
                if a < b:
                    call_range_kernel(table[i, 0], argvs[i].ctypes.data, a - tiles[i], b - tiles[i])
    return matmul._alive(argvs, xq) + next_tile[0]


@njit(cache=True)
def _expert_launch(starts, tables, widths):
    """Launch rows for the routed experts (those with rows): each expert's weight from every table,
    over its rows, at column offsets `widths` cumulated."""
    active = np.nonzero(starts[1:] > starts[:-1])[0]
    n = len(tables)
    table = np.empty((n * active.shape[0], matmul.TABLE_LEN), np.int64)
    rows = np.empty((n * active.shape[0], 2), np.int64)
    cols = np.zeros(n * active.shape[0], np.int64)
    for i in range(active.shape[0]):
        e = active[i]
        for j in range(n):
            table[n * i + j] = tables[j][e]
            rows[n * i + j, 0], rows[n * i + j, 1] = starts[e], starts[e + 1]
            cols[n * i + j] = widths[j]
    return table, rows, cols


@njit(cache=True)
def moe_ffn(h, router, gate, up, down, gemm, quantize, k, renorm, out, stats, nth) -> None:
    """out (T, dim) = for each token, the sum over its k routed experts of weight * down(silu(gate(h))
    * up(h)). router: a (1, matmul.TABLE_LEN) launch table of the (experts, dim) router; gate, up, down:
    (experts, matmul.TABLE_LEN) tables, one row per expert. stats[STAT_BYTES] += the expert bytes
    launched, stats[STAT_ROWS] += T."""
    none1, none2 = np.empty(0, np.float32), np.empty((0, 0), np.float32)
    moe_ffn_ext(h, h, router, gate, up, down, gemm, quantize, k, renorm, ACT_SILU, none1, none2, none2, none2,
                none1, out, stats, nth)  # fmt: skip


@njit(cache=True)
def moe_ffn_ext(h, hr, router, gate, up, down, gemm, quantize, k, renorm, act_kind, rb, gb, ub, db, ds, out,
                stats, nth):  # fmt: skip
    """moe_ffn with gpt-oss's and gemma4's parts: the router reads hr (h itself, or gemma4's own router
    input); rb (E,) added to the router logits, gb / ub (E, f) and db (E, dim) added to each expert's
    gate / up / down outputs, ds (E,) each expert's down output scale (empty arrays: none); act_kind
    one of ACT_*."""
    T, d = h.shape
    E = router[0, 3]
    logits = np.empty((T, E), np.float32)
    matmul.launch_many(router, gemm, quantize, hr, np.array([[logits.ctypes.data, E]], np.int64), nth)
    if rb.size:
        for t in range(T):
            logits[t] += rb
    ids = np.empty((T, k), np.int64)
    weights = np.empty((T, k), np.float32)
    route(logits, k, renorm, ids, weights)
    if ds.size:  # scaling the weight scales the expert's output (llama.cpp: down output, then weight)
        for t in range(T):
            for j in range(k):
                weights[t, j] *= ds[ids[t, j]]
    starts, order, slot = group_by_expert(ids, E)
    xg = np.empty((T * k, d), np.float32)
    for r in range(T * k):
        xg[r] = h[order[r]]
    f = gate[0, 3]
    table, rows, cols = _expert_launch(starts, (gate, up), np.array([0, f], np.int64))
    gu = np.empty((T * k, 2 * f), np.float32)
    launch_segments(table, rows, cols, gemm, quantize, xg, gu, nth)
    _add_expert_rows(starts, gb, gu[:, :f])
    _add_expert_rows(starts, ub, gu[:, f:])
    act = np.empty((T * k, f), np.float32)
    if act_kind == ACT_OAI:
        swiglu_oai_rows(gu[:, :f], gu[:, f:], act)
    elif act_kind == ACT_GELU:
        geglu_rows(gu[:, :f], gu[:, f:], act)
    else:
        swiglu_rows(gu[:, :f], gu[:, f:], act)
    table2, rows2, cols2 = _expert_launch(starts, (down,), np.zeros(1, np.int64))
    dn = np.empty((T * k, d), np.float32)
    launch_segments(table2, rows2, cols2, gemm, quantize, act, dn, nth)
    _add_expert_rows(starts, db, dn)
    _combine(weights, slot, dn, out)
    stats[STAT_BYTES] += table[:, 2].sum() + table2[:, 2].sum()
    stats[STAT_ROWS] += T


@njit(cache=True)
def _add_expert_rows(starts, bias, y) -> None:
    """y[r] += bias[e] for the rows r of each expert e (starts as group_by_expert's); empty bias: none."""
    if bias.size == 0:
        return
    for e in range(starts.shape[0] - 1):
        for r in range(starts[e], starts[e + 1]):
            for c in range(y.shape[1]):
                y[r, c] += bias[e, c]


@njit(cache=True)
def _combine(weights, slot, dn, out) -> None:
    """out[t] = sum over j of weights[t, j] * dn[slot[t, j]], in routing order (as llama.cpp adds)."""
    T, k = weights.shape
    for t in range(T):
        for c in range(out.shape[1]):
            out[t, c] = f32(0.0)
        for j in range(k):
            r, wj = slot[t, j], weights[t, j]
            for c in range(out.shape[1]):
                out[t, c] += wj * dn[r, c]


@njit(cache=True, fastmath=True, error_model="numpy")
def sigmoid_gate(h, weight, out) -> None:
    """out[t] = sigmoid(h[t] . weight): the shared expert's gate (qwen2moe), for h (T, dim)."""
    for t in range(h.shape[0]):
        s = f32(0.0)
        for j in range(h.shape[1]):
            s += h[t, j] * weight[j]
        out[t] = f32(1.0) / (f32(1.0) + np.exp(-s))
