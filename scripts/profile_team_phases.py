"""Where kernels/team_stack.py's team spends a decode step: a copy of its worker with cycle-counter stamps
at each phase's arrival, work and exit, per thread.

    python scripts/profile_team_phases.py MODEL.gguf -t 1,2 -n 48 --rounds 4

Dense layers only (as the team). Each figure is the lowest over every step of every round (other tenants
only ever add time) per layer and phase, summed over the layers, in microseconds: the phase's span (first
arrival to last exit), the work done in it (summed over threads) and each thread's wait.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange
from profile_stack_sections import Shim, profile_decode, rdtsc

from localllm.kernels import attention, matmul
from localllm.kernels import decoder as dk
from localllm.kernels import team_stack as ts
from localllm.kernels.sync import PHASE_WORDS, claim, complete, serial_first, wait_complete

NAMES = ("norm+quant", "qkv", "rope+store", "attention", "quant att", "o", "residual+norm+quant", "gate_up",
         "act+quant", "down")  # fmt: skip
MAXT = 4  # threads recorded


@njit
def _serial(sync, ph, rec, c, which, il, x, w, dims, step, kv, lb, tp, qa, qb, qc):
    t0 = rdtsc()
    if serial_first(sync, ph):
        T = x.shape[0]  # (a decode step: the row-wise phases are one piece, as in the team)
        if which == 0:
            ts._layer_input(il, x, w, dims, lb, qa, 0, T)
        elif which == 2:
            ts._attention_prologue(il, w, dims, step, kv, lb)
        elif which == 4:
            ts._quantize(w, lb.att.reshape(T, -1), qb, 0, T)
        elif which == 6:
            ts._ffn_input(il, x, w, dims, lb, qa, 0, T)
        else:
            ts._down_input(il, w, lb, tp, qc, 0, T)
        complete(sync, ph)
    t1 = rdtsc()
    wait_complete(sync, ph, 1)
    rec[il, which, c, 0], rec[il, which, c, 1], rec[il, which, c, 2] = t0, t1 - t0, rdtsc()


@njit
def _parallel(sync, ph, rec, c, which, il, w, dims, step, kv, lb, tp, g):
    """ts._projection / ts._attention with each piece's time added to the thread's work."""
    t0, work = rdtsc(), 0
    if g < 0:
        k_cache, v_cache, _, tables = dk._layer_cache(il, w, step, kv)
        window, cap = w.flags[il, dk.F_WINDOW], w.softcap[il]
        sinks = w.sinks[il] if w.flags[il, dk.F_SINKS] else w.sinks[il, :0]
        items, pieces = tp.items[il, : tp.n_items[il]], tp.att_pieces[il]
    else:
        nw, pieces = tp.nw[il, g], tp.pieces[il, g]
        table, argv, tiles, bounds = (
            tp.tables[il, g, :nw],
            tp.argv[il, g, :nw],
            tp.tiles[il, g],
            tp.bounds[il, g],
        )
    while True:
        p = claim(sync, ph)
        if p >= pieces:
            break
        a = rdtsc()
        if g < 0:
            attention.attend_items(lb.q, k_cache, v_cache, step.qsl, step.ctx, tables, dims.attn_scale,
                                   window, cap, sinks, items, lb.att, p, pieces)  # fmt: skip
        else:
            matmul.run_piece(table, argv, tiles, bounds[p], bounds[p + 1])
        work += rdtsc() - a
        complete(sync, ph)
    wait_complete(sync, ph, pieces)
    rec[il, which, c, 0], rec[il, which, c, 1], rec[il, which, c, 2] = t0, work, rdtsc()


@njit
def worker_p(c, x, w, dims, step, kv, buf, tp, qa, qb, qc, sync, rec):
    L = w.flags.shape[0]
    for il in range(L):
        lb, ph = dk._views(buf, il, w, dims), il * ts.PHASES
        args = (x, w, dims, step, kv, lb, tp, qa, qb, qc)
        _serial(sync, ph, rec, c, 0, il, *args)
        _parallel(sync, ph + 1, rec, c, 1, il, w, dims, step, kv, lb, tp, ts.G_QKV)
        _serial(sync, ph + 2, rec, c, 2, il, *args)
        _parallel(sync, ph + 3, rec, c, 3, il, w, dims, step, kv, lb, tp, -1)
        _serial(sync, ph + 4, rec, c, 4, il, *args)
        _parallel(sync, ph + 5, rec, c, 5, il, w, dims, step, kv, lb, tp, ts.G_O)
        _serial(sync, ph + 6, rec, c, 6, il, *args)
        _parallel(sync, ph + 7, rec, c, 7, il, w, dims, step, kv, lb, tp, ts.G_GATE_UP)
        _serial(sync, ph + 8, rec, c, 8, il, *args)
        _parallel(sync, ph + 9, rec, c, 9, il, w, dims, step, kv, lb, tp, ts.G_DOWN)
    if serial_first(sync, L * ts.PHASES):
        ts._tail(L - 1, x, w, dims, dk._views(buf, L - 1, w, dims), 0, x.shape[0])


@njit(parallel=True)
def team_p(x, w, dims, step, kv, buf, tp, qa, qb, qc, sync, rec, nth):
    for c in prange(nth):
        worker_p(c, x, w, dims, step, kv, buf, tp, qa, qb, qc, sync, rec)


@njit
def stack_p(x, w, dims, step, kv, nth, rec, total):
    t0 = rdtsc()
    half = max(1, step.rope_freqs.shape[1])
    buf = dk._buffers(x.shape[0], x.shape[1], dims, step.rope_dims.shape[0], half)
    dk._rotations(step, buf)
    acts = ts._acts(x, dims)
    tp = ts._plan(x, w, dims, step, buf, acts, nth)
    sync = np.zeros((w.flags.shape[0] * ts.PHASES + 1, PHASE_WORDS), np.int64)
    tw = ts._team_weights(w)
    total[0] = rdtsc() - t0
    if nth <= 1:
        worker_p(0, x, tw, dims, step, kv, buf, tp, acts.qa, acts.qb, acts.qc, sync, rec)
    else:
        team_p(x, tw, dims, step, kv, buf, tp, acts.qa, acts.qb, acts.qc, sync, rec, nth)
    total[1] = rdtsc() - t0
    return buf.q.size + tp.argv.size + acts.qa.x8.size + acts.qb.x8.size + acts.qc.x8.size + tp.x16.size


class Recorder:
    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def __call__(self, x: Any, w: Any, dims: Any, step: Any, kv: Any, nth: int) -> int:
        if x.shape[0] != 1:
            return ts.team_stack(x, w, dims, step, kv, nth)
        rec = np.zeros((w.flags.shape[0], len(NAMES), MAXT, 3), np.int64)
        total = np.zeros(2, np.int64)
        out = stack_p(x, w, dims, step, kv, nth, rec, total)
        self.rows.setdefault(nth, []).append((rec, total))
        return out


def report(rows: list[tuple[np.ndarray, np.ndarray]], nth: int, per_us: float) -> None:
    r = np.stack([a for a, _ in rows])[..., :nth, :]  # (steps, layers, phases, threads, 3)
    tot = np.stack([b for _, b in rows]) / per_us
    enter, busy, leave = r[..., 0], r[..., 1] / per_us, r[..., 2]
    span = (leave.max(-1) - enter.min(-1)) / per_us  # (steps, layers, phases)
    print(f"\n{nth} thread(s), {len(rows)} steps; lowest per layer and phase, summed over layers (us):")
    for p, name in enumerate(NAMES):
        low = lambda a, p=p: a[:, :, p].min(axis=0).sum()  # noqa: E731
        waits = " ".join(f"{low((leave - enter)[..., c] / per_us - busy[..., c]):6.1f}" for c in range(nth))
        share = np.median(busy[:, :, p].max(-1) / np.maximum(busy[:, :, p].sum(-1), 1e-9))
        print(
            f"  {name:20s} span {low(span):7.1f}  work {low(busy.sum(-1)):7.1f}  waits {waits}  "
            f"busiest thread's share {share:.2f}"
        )
    print(
        f"  set-up (buffers, plan) {tot[:, 0].min():.1f}; whole stack lowest {tot[:, 1].min():.1f}, "
        f"median {np.median(tot[:, 1]):.1f}; phases' lowest spans summed {span.min(axis=0).sum():.1f}"
    )
    if nth > 1:
        _lags(enter, busy, per_us)


def _lags(enter: np.ndarray, busy: np.ndarray, per_us: float) -> None:
    """How far apart the first two threads reach each phase, and how often both worked on a projection."""
    lag = np.median(np.abs(enter[..., 0] - enter[..., 1]) / per_us, axis=0)  # (layers, phases)
    print("  arrival lag between threads 0 and 1 per phase, median (us), layers 0, 1, last:")
    for il in (0, 1, lag.shape[0] - 1):
        print("   ", " ".join(f"{v:7.1f}" for v in lag[il]))
    both = (busy > 0).all(-1)[:, :, [1, 5, 7, 9]].mean()
    print(f"  projections that both threads worked on: {both:.2f}")


def _patch(rec: Recorder) -> None:
    import localllm.backends.numba_stack as ns

    ns.team_stack = Shim(ts, "team_stack", rec)


def main() -> None:
    profile_decode(__doc__.splitlines()[0], _patch, Recorder(), True, report)


if __name__ == "__main__":
    main()
