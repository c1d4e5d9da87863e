"""kernels/decoder.py's layer stack run by one team of threads for the whole step.

decoder_stack runs the serial parts (norms, rotation, KV store, residuals) on the calling thread and
starts a parallel launch per projection: ~4 launches a layer, each ~6 us of Numba's launch machinery on
one thread and 15-20 us on two (a syscall, a schedule, waking the team), ~0.5 ms of a ~9 ms 2-thread
decode step of a 120 MB model, and the attention ran on one thread. Here one parallel region runs every
layer: the threads go through the same phases (kernels/sync.py), each phase a serial part that the first
thread to arrive runs while the others wait (the rotation and KV store), the pieces of a projection
(kernels/pieces.py) or of the attention, or a row-wise part (norms, residuals, the FFN's activation, the
8-bit inputs) whose rows they split in a prompt's steps. Every value is computed by the same kernels on
the same inputs as in decoder_stack, so the results are the same bits; which thread computes a piece
does not matter.

Dense layers only (no experts, per-layer inputs or parallel experts): DecoderPlan takes decoder_stack for
the others. With one thread the phases run in order on the calling thread, with no launch at all.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from . import attention, layers, matmul
from . import decoder as dk
from .pieces import PIECES_PER_THREAD, piece_bounds, piece_count, weight_tiles
from .quantize_act import quantize_rows16_into, quantize_rows_into, with_residual
from .sync import PHASE_WORDS, claim, complete, serial_first, wait_complete

G_QKV, G_O, G_GATE_UP, G_DOWN = range(4)  # a layer's projections
PHASES = 10  # a layer's phases (see _worker); the step ends with one more (the last layer's tail)
WMAX = 3  # weights in one projection (q, k, v)
# The row-wise phases (norms, residuals, the FFN's activation, the 8-bit rounding of every projection's
# input) are split over the team by rows in a prompt's steps, at least this many rows a piece: run by one
# thread they were ~7% of a 2-thread prefill, and more of it with more threads.
ROWS_PER_PIECE = 8
LAYER_INPUT, ATT_OUTPUT, FFN_INPUT, DOWN_INPUT = range(4)  # the row-wise phases (_rows_phase)


class ActQ(NamedTuple):
    """Flat buffers of one input's 8-bit activations (quantize_act.quantize_rows), viewed per use."""

    x8: np.ndarray
    dx: np.ndarray
    sx: np.ndarray
    hs: np.ndarray
    x8p: np.ndarray


class TeamPlan(NamedTuple):
    """Every projection of the step, ready to run: launch tables, argvs, tiles and piece bounds per
    (layer, projection), the attention's work items per layer, and the activations' buffers."""

    tables: np.ndarray  # (L, 4, WMAX, matmul.TABLE_LEN)
    argv: np.ndarray  # (L, 4, WMAX, ARGV_LEN)
    nw: np.ndarray  # (L, 4) weights per projection
    tiles: np.ndarray  # (L, 4, WMAX + 1)
    bounds: np.ndarray  # (L, 4, pieces + 1)
    pieces: np.ndarray  # (L, 4)
    items: np.ndarray  # (L, items, 4) attention.work_items
    n_items: np.ndarray  # (L,)
    att_pieces: np.ndarray  # (L,)
    x16: np.ndarray  # (T * ffn) int16 and (T * ffn / 32) scales: an int16 down projection's input
    dx16: np.ndarray
    row_pieces: int  # pieces of a row-wise phase (1 in a decode step)


class Acts(NamedTuple):
    """The 8-bit activations' buffers (ActQ each; a parallel region's arguments are flat tuples, so
    they travel as three arguments)."""

    qa: ActQ  # the normed input (q/k/v, gate/up), dim wide
    qb: ActQ  # the attention output, n_heads * head_dim wide
    qc: ActQ  # the FFN activation, ffn wide (2T rows for a two-pass down projection)


class TeamWeights(NamedTuple):
    """What the phases read of decoder.StackWeights, flat (a parallel region's tuple arguments may
    hold arrays and scalars, not tuples: StackWeights holds Extras). Field names as StackWeights'
    (decoder's helpers read them by name)."""

    flags: np.ndarray
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    post_attn_norm: np.ndarray
    post_ffn_norm: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    v_norm: np.ndarray
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray
    softcap: np.ndarray
    attn_temp: np.ndarray
    out_scale: np.ndarray
    sinks: np.ndarray  # Extras.sinks
    bo: np.ndarray  # Extras.bo
    quantize: bool


@njit(cache=True)
def _team_weights(w):
    return TeamWeights(w.flags, w.attn_norm, w.ffn_norm, w.post_attn_norm, w.post_ffn_norm, w.q_norm,
                       w.k_norm, w.v_norm, w.bq, w.bk, w.bv, w.softcap, w.attn_temp, w.out_scale,
                       w.extras.sinks, w.extras.bo, w.quantize)  # fmt: skip


@njit(cache=True)
def _act_q(rows, k):
    f, i8 = np.float32, np.int8
    return ActQ(np.empty(rows * k, i8), np.empty(rows * k // 32, f), np.empty(rows * k // 32, f),
                np.empty(rows * k // 16, np.int32), np.empty(rows * k, i8))  # fmt: skip


@njit(cache=True)
def _view_q(q, r0, r1, k):
    """Rows r0:r1 of q's rows x k activations as quantize_rows_into's (x8, dx, sx, hs, x8p)."""
    n, a, b = r1 - r0, r0 * k, r1 * k
    return (q.x8[a:b].reshape(n, k), q.dx[a // 32 : b // 32].reshape(n, k // 32),
            q.sx[a // 32 : b // 32].reshape(n, k // 32), q.hs[a // 16 : b // 16].reshape(n, k // 16),
            q.x8p[a:b].reshape(n, k))  # fmt: skip


@njit(cache=True)
def _fill_argv(argv, row, x, y, ldy, q, x16, dx16, gemm) -> None:
    """matmul._argv for the weight `row` of a table (fn, address, bytes, n, k) into argv, in place:
    input x (T, k), output at address y with rows ldy apart, 8-bit activations in q (an int16 kernel
    reads x16 / dx16 instead)."""
    m = matmul
    argv[:] = 0
    argv[m.A_BUF], argv[m.A_NBYTES], argv[m.A_N], argv[m.A_K] = row[1], row[2], row[3], row[4]
    argv[m.A_T], argv[m.A_X], argv[m.A_Y], argv[m.A_LDY] = x.shape[0], x.ctypes.data, y, ldy
    argv[m.A_X8], argv[m.A_DX], argv[m.A_SX] = q.x8.ctypes.data, q.dx.ctypes.data, q.sx.ctypes.data
    argv[m.A_HS], argv[m.A_X8P], argv[m.A_GEMM] = q.hs.ctypes.data, q.x8p.ctypes.data, gemm
    if x16.size:
        argv[m.A_X8], argv[m.A_DX], argv[m.A_GEMM] = x16.ctypes.data, dx16.ctypes.data, 0


@njit(cache=True)
def _set_projection(tp, il, g, table, x, outs, q, nth, gemm, int16) -> None:
    """(layer il, projection g): table's weights on x into the arrays `outs` (one per weight)."""
    W = table.shape[0]
    tp.nw[il, g] = W
    x16 = tp.x16 if int16 else tp.x16[:0]
    for i in range(W):
        tp.tables[il, g, i, : table.shape[1]] = table[i]  # (the int16 table has no T_ROUND)
        out = outs[i]
        _fill_argv(tp.argv[il, g, i], table[i], x, out.ctypes.data, out.size // out.shape[0], q, x16, tp.dx16,
                   gemm)  # fmt: skip
    tiles = weight_tiles(table)
    tp.tiles[il, g, : W + 1] = tiles
    pieces = piece_count(tiles[-1], nth, x.shape[1] // 32 * x.shape[0])
    tp.pieces[il, g] = pieces
    piece_bounds(table, tiles, pieces, tp.bounds[il, g])


@njit(cache=True)
def _plan(x, w, dims, step, buf, acts, nth):
    """The step's TeamPlan (serial, before the team starts: a few us)."""
    L, T = w.flags.shape[0], x.shape[0]
    f, i64 = np.float32, np.int64
    n16 = T * dims.ffn_dim if (w.flags[:, dk.F_DOWN] == dk.DOWN_INT16).any() else 0
    max_items = (T + step.ctx.shape[0]) * dims.n_kv_heads  # (a sequence's chunks are at most its queries)
    pmax = max(1, nth * PIECES_PER_THREAD)
    tp = TeamPlan(np.zeros((L, 4, WMAX, matmul.TABLE_LEN), i64), np.zeros((L, 4, WMAX, matmul.ARGV_LEN), i64),
                  np.zeros((L, 4), i64), np.zeros((L, 4, WMAX + 1), i64), np.zeros((L, 4, pmax + 1), i64),
                  np.zeros((L, 4), i64), np.zeros((L, max_items, 4), i64), np.zeros(L, i64), np.zeros(L, i64),
                  np.empty(n16, np.int16), np.empty(n16 // 32, f),
                  1 if nth <= 1 else max(1, min(pmax, T // ROWS_PER_PIECE)))  # fmt: skip
    for il in range(L):
        _plan_layer(tp, il, x, w, step, dk._views(buf, il, w, dims), acts, nth)
    return tp


@njit(cache=True)
def _acts(x, dims):
    t2 = 2 * x.shape[0] if dims.two_pass else x.shape[0]
    T = x.shape[0]
    return Acts(_act_q(T, x.shape[1]), _act_q(T, dims.n_heads * dims.head_dim), _act_q(t2, dims.ffn_dim))


@njit(cache=True)
def _plan_layer(tp, il, x, w, step, lb, acts, nth) -> None:
    T, gemm = x.shape[0], w.gemm
    stores = w.flags[il, dk.F_KV_LAYER] == il
    if stores:
        _set_projection(tp, il, G_QKV, w.qkv[il], lb.h, (lb.q, lb.k, lb.v), acts.qa, nth, gemm, False)
    else:
        _set_projection(tp, il, G_QKV, w.qkv[il, :1], lb.h, (lb.q,), acts.qa, nth, gemm, False)
    _set_projection(tp, il, G_O, w.o[il], lb.att.reshape(T, -1), (lb.o,), acts.qb, nth, gemm, False)
    _set_projection(tp, il, G_GATE_UP, w.gate_up[il], lb.h, (lb.gate, lb.up), acts.qa, nth, gemm, False)
    mode = w.flags[il, dk.F_DOWN]
    if mode == dk.DOWN_INT16:
        _set_projection(tp, il, G_DOWN, w.down16[il : il + 1], lb.act, (lb.down,), acts.qc, nth, 0, True)
    elif mode == dk.DOWN_TWO_PASS and w.quantize:
        _set_projection(tp, il, G_DOWN, w.down[il], lb.act2, (lb.down2,), acts.qc, nth, gemm, False)
    else:
        _set_projection(tp, il, G_DOWN, w.down[il], lb.act, (lb.down,), acts.qc, nth, gemm, False)
    kvh = w.flags[il, dk.F_KV_HEADS]
    items = attention.work_items(step.qsl, step.ctx, kvh, attention.queries_per_item(lb.q.shape[1], kvh))
    tp.items[il, : items.shape[0]] = items
    tp.n_items[il] = items.shape[0]
    tp.att_pieces[il] = 1 if nth <= 1 else max(1, min(items.shape[0], nth * PIECES_PER_THREAD))


# ---- the phases ---------------------------------------------------------------------------------


@njit(cache=True)
def _projection(tp, il, g, sync, phase) -> None:
    """Take pieces of projection g of layer il until none is left, then wait for the others' pieces."""
    nw, pieces = tp.nw[il, g], tp.pieces[il, g]
    table, argv, tiles, bounds = tp.tables[il, g, :nw], tp.argv[il, g, :nw], tp.tiles[il, g], tp.bounds[il, g]
    while True:
        p = claim(sync, phase)
        if p >= pieces:
            break
        matmul.run_piece(table, argv, tiles, bounds[p], bounds[p + 1])
        complete(sync, phase)
    wait_complete(sync, phase, pieces)


@njit(cache=True)
def _attention(il, w, dims, step, kv, lb, tp, sync, phase) -> None:
    """Pieces of the layer's attention work items (piece p: items p, p + pieces, ...: causal prefill's
    later chunks see more keys), as decoder._attend computes them."""
    k_cache, v_cache, _, tables = dk._layer_cache(il, w, step, kv)
    window, cap = w.flags[il, dk.F_WINDOW], w.softcap[il]
    sinks = w.sinks[il] if w.flags[il, dk.F_SINKS] else w.sinks[il, :0]
    items, pieces = tp.items[il, : tp.n_items[il]], tp.att_pieces[il]
    while True:
        p = claim(sync, phase)
        if p >= pieces:
            break
        attention.attend_items(lb.q, k_cache, v_cache, step.qsl, step.ctx, tables, dims.attn_scale, window,
                               cap, sinks, items, lb.att, p, pieces)  # fmt: skip
        complete(sync, phase)
    wait_complete(sync, phase, pieces)


@njit(cache=True)
def _rounding(tp, il, g) -> int:
    """The activation rounding of projection g of layer il (matmul.table_rounding)."""
    return matmul.table_rounding(tp.tables[il, g, : tp.nw[il, g]], True)


@njit(cache=True)
def _quantize(w, x, q, r0, r1, rounding) -> None:
    """Rows r0:r1 of x (T, k) to 8 bits, rounded as `rounding` says, into the same rows of q."""
    if w.quantize:
        quantize_rows_into(x[r0:r1], _view_q(q, r0, r1, x.shape[1]), rounding)


@njit(cache=True)
def _tail(il, x, w, dims, lb, r0, r1) -> None:
    """The end of layer il for rows r0:r1: a two-pass down projection's sum, the FFN's residual, the
    output scale."""
    if w.flags[il, dk.F_DOWN] == dk.DOWN_TWO_PASS and w.quantize:
        T = x.shape[0]
        for t in range(r0, r1):
            for j in range(lb.down.shape[1]):
                lb.down[t, j] = lb.down2[t, j] + lb.down2[T + t, j]
    xr = x[r0:r1]
    dk._residual(xr, lb.down[r0:r1], w.flags[il, dk.F_POST_FFN], w.post_ffn_norm[il], dims.eps, lb.h[r0:r1])
    if w.out_scale[il] != 1.0:
        dk._scale_rows(xr, w.out_scale[il])


@njit(cache=True)
def _layer_input(il, x, w, dims, lb, tp, qa, r0, r1) -> None:
    """Rows r0:r1: the layer before's tail, then this layer's normed input in 8 bits."""
    if il > 0:
        _tail(il - 1, x, w, dims, lb, r0, r1)
    layers.rms_norm_rows(x[r0:r1], w.attn_norm[il], dims.eps, lb.h[r0:r1])
    _quantize(w, lb.h, qa, r0, r1, _rounding(tp, il, G_QKV))


@njit(cache=True)
def _attention_prologue(il, w, dims, step, kv, lb) -> None:
    """Biases, q/k/v norms, rotation and the KV store (decoder._qkv_finish and _rope_attend's first half)."""
    stores = w.flags[il, dk.F_KV_LAYER] == il
    q, k = dk._qkv_finish(il, w, dims, lb, stores)
    k_cache, v_cache, slots, _ = dk._layer_cache(il, w, step, kv)
    r = w.flags[il, dk.F_ROPE]
    dim, neox = step.rope_dims[r, 0], step.rope_dims[r, 1] != 0
    if stores:
        layers.rope_store_kv(q, k, lb.v, lb.cos[r], lb.sin[r], dim, neox, k_cache, v_cache, slots, lb.q, lb.k)
    else:
        layers.rope_apply(q, lb.cos[r], lb.sin[r], dim, neox, lb.q)
    if w.attn_temp[il, 0] != 0.0:
        dk._temperature(lb.q, step.positions, w.attn_temp[il, 0], w.attn_temp[il, 1])


@njit(cache=True)
def _ffn_input(il, x, w, dims, lb, tp, qa, r0, r1) -> None:
    """Rows r0:r1: the attention's residual (after its output bias and post-norm), then the FFN's normed
    input."""
    xr, o, h = x[r0:r1], lb.o[r0:r1], lb.h[r0:r1]
    if w.flags[il, dk.F_O_BIAS]:
        dk._add_bias(o, w.bo[il])
    dk._residual(xr, o, w.flags[il, dk.F_POST_ATTN], w.post_attn_norm[il], dims.eps, h)
    layers.rms_norm_rows(xr, w.ffn_norm[il], dims.eps, h)
    _quantize(w, lb.h, qa, r0, r1, _rounding(tp, il, G_GATE_UP))


@njit(cache=True)
def _down_input(il, w, lb, tp, qc, r0, r1) -> None:
    """Rows r0:r1 of the FFN's activation, and of the down projection's input in its rounding
    (decoder._down); a two-pass down projection's input takes every row at once (r0:r1 = 0:T)."""
    gate, up, act = lb.gate[r0:r1], lb.up[r0:r1], lb.act[r0:r1]
    if w.flags[il, dk.F_GELU]:
        layers.geglu_rows(gate, up, act)
    elif w.flags[il, dk.F_OAI]:
        layers.swiglu_oai_rows(gate, up, act)
    else:
        layers.swiglu_rows(gate, up, act)
    mode = w.flags[il, dk.F_DOWN]
    T, k = lb.act.shape[0], lb.act.shape[1]
    if mode == dk.DOWN_INT16:
        x16, dx16 = tp.x16[: T * k].reshape(T, k), tp.dx16[: T * k // 32].reshape(T, k // 32)
        quantize_rows16_into(act, x16[r0:r1], dx16[r0:r1])
    elif _whole_down_input(il, w):
        rounding = _rounding(tp, il, G_DOWN)  # (exact sums: numba_stack._precise_down)
        with_residual(lb.act, lb.act2, rounding)
        _quantize(w, lb.act2, qc, 0, 2 * T, rounding)
    else:
        _quantize(w, lb.act, qc, r0, r1, _rounding(tp, il, G_DOWN))


@njit(cache=True)
def _whole_down_input(il, w) -> bool:
    """A two-pass down projection's input (with_residual: every row, then its residual) is one piece."""
    return w.flags[il, dk.F_DOWN] == dk.DOWN_TWO_PASS and w.quantize


@njit(cache=True)
def _rows_phase(kind, il, x, w, dims, lb, tp, q, sync, phase) -> None:
    """Pieces of a row-wise phase (rows split evenly; one piece in a decode step), then wait for the
    others' pieces. Each row's values are those the whole phase on one thread computes."""
    T = x.shape[0]
    pieces = 1 if kind == DOWN_INPUT and _whole_down_input(il, w) else tp.row_pieces
    while True:
        p = claim(sync, phase)
        if p >= pieces:
            break
        r0, r1 = p * T // pieces, (p + 1) * T // pieces
        if kind == LAYER_INPUT:
            _layer_input(il, x, w, dims, lb, tp, q, r0, r1)
        elif kind == ATT_OUTPUT:
            _quantize(w, lb.att.reshape(T, -1), q, r0, r1, _rounding(tp, il, G_O))
        elif kind == FFN_INPUT:
            _ffn_input(il, x, w, dims, lb, tp, q, r0, r1)
        else:
            _down_input(il, w, lb, tp, q, r0, r1)
        complete(sync, phase)
    wait_complete(sync, phase, pieces)


@njit(cache=True)
def _worker(x, w, dims, step, kv, buf, tp, qa, qb, qc, sync) -> None:
    """One thread's walk through the step's phases (every thread of the team runs this)."""
    L = w.flags.shape[0]
    for il in range(L):
        lb, ph = dk._views(buf, il, w, dims), il * PHASES
        _rows_phase(LAYER_INPUT, il, x, w, dims, lb, tp, qa, sync, ph)
        _projection(tp, il, G_QKV, sync, ph + 1)
        if serial_first(sync, ph + 2):
            _attention_prologue(il, w, dims, step, kv, lb)
            complete(sync, ph + 2)
        wait_complete(sync, ph + 2, 1)
        _attention(il, w, dims, step, kv, lb, tp, sync, ph + 3)
        _rows_phase(ATT_OUTPUT, il, x, w, dims, lb, tp, qb, sync, ph + 4)
        _projection(tp, il, G_O, sync, ph + 5)
        _rows_phase(FFN_INPUT, il, x, w, dims, lb, tp, qa, sync, ph + 6)
        _projection(tp, il, G_GATE_UP, sync, ph + 7)
        _rows_phase(DOWN_INPUT, il, x, w, dims, lb, tp, qc, sync, ph + 8)
        _projection(tp, il, G_DOWN, sync, ph + 9)
    if serial_first(sync, L * PHASES):  # the others may leave: the region's end waits for this one
        _tail(L - 1, x, w, dims, dk._views(buf, L - 1, w, dims), 0, x.shape[0])


@njit(cache=True, parallel=True, nogil=True)
def _team(x, w, dims, step, kv, buf, tp, qa, qb, qc, sync, nth) -> None:
    for _c in prange(nth):
        _worker(x, w, dims, step, kv, buf, tp, qa, qb, qc, sync)


@njit(cache=True, nogil=True)
def team_stack(x, w, dims, step, kv, nth):
    """decoder.decoder_stack for dense layers (see the module's docstring): every layer on x (T, dim),
    in place, on a team of nth threads."""
    half = max(1, step.rope_freqs.shape[1])
    buf = dk._buffers(x.shape[0], x.shape[1], dims, step.rope_dims.shape[0], half)
    dk._rotations(step, buf)
    acts = _acts(x, dims)
    tp = _plan(x, w, dims, step, buf, acts, nth)
    sync = np.zeros((w.flags.shape[0] * PHASES + 1, PHASE_WORDS), np.int64)
    tw = _team_weights(w)
    if nth <= 1:
        _worker(x, tw, dims, step, kv, buf, tp, acts.qa, acts.qb, acts.qc, sync)
    else:
        _team(x, tw, dims, step, kv, buf, tp, acts.qa, acts.qb, acts.qc, sync, nth)
    # keep the buffers alive past the kernels that only saw their addresses
    return buf.q.size + buf.act2.size + buf.down2.size + tp.argv.size + acts.qa.x8.size + acts.qb.x8.size \
        + acts.qc.x8.size + tp.x16.size  # fmt: skip


def supports(flags: np.ndarray) -> bool:
    """Whether team_stack runs layers with these decoder flags (dense ones: no experts, per-layer inputs
    or parallel experts)."""
    return not flags[:, [dk.F_EXPERTS, dk.F_PER_LAYER, dk.F_PARALLEL]].any()
