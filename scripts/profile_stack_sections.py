"""Where a decode step's fused layer stack spends its time: a copy of kernels/decoder.py's dense-layer path
(a parallel launch per projection; kernels/team_stack.py's team is not profiled here)
with cycle-counter stamps between its sections, and inside every parallel launch (serial set-up, each
thread's start and end, the join).

    python scripts/profile_stack_sections.py MODEL.gguf -t 1,2 -n 48 --rounds 4

Dense layers with RoPE only (llama-like, smollm3, mistral3): other layer kinds are refused. Each section's
figure is its lowest time over every step of every round (a shared machine's other tenants only ever add
time), summed over the layers, in microseconds; rounds alternate the thread counts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from localllm.kernels import decoder as dk
from localllm.kernels import layers, matmul
from localllm.kernels.pieces import plan_pieces
from localllm.kernels.simd import fetch_add

SECTIONS = ("attn_norm", "qkv", "qkv_finish", "rope_store", "attend", "o", "residual", "ffn_norm",
            "gate_up", "swiglu", "down", "residual2")  # fmt: skip
LAUNCHES = {1: "qkv", 5: "o", 8: "gate_up", 10: "down"}
# per (layer, section): begin, end; launches also: set-up end, thread 0 start/end, thread 1 start/end
COLS = 8


@intrinsic
def rdtsc(typingctx):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), [])
        )
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(parallel=True, nogil=True)
def launch_many_p(table, gemm, quantize, x, outs, nth, rec):
    xq = matmul._quantized(x, quantize)
    argvs, tiles = matmul._group_argvs(table, gemm, x, outs, xq)
    nth = max(1, min(nth, tiles[-1]))
    bounds = plan_pieces(table, nth, x.shape[1] // 32 * x.shape[0])[1]
    next_piece = np.zeros(1, np.int64)
    rec[2] = rdtsc()
    for c in prange(nth):
        rec[3 + 2 * c] = rdtsc()
        while True:
            p = fetch_add(next_piece.ctypes.data, 1)
            if p >= bounds.shape[0] - 1:
                break
            matmul.run_piece(table, argvs, tiles, bounds[p], bounds[p + 1])
        rec[4 + 2 * c] = rdtsc()
    return matmul._alive(argvs, xq) + next_piece[0]


@njit
def project_p(table, w, x, outs, nth, rec):
    dest = np.empty((len(outs), 2), np.int64)
    for i in range(len(outs)):
        dest[i, 0], dest[i, 1] = outs[i].ctypes.data, outs[i].size // outs[i].shape[0]
    rec[0] = rdtsc()
    launch_many_p(table, w.gemm, w.quantize, x, dest, nth, rec)
    rec[1] = rdtsc()


@njit
def layer_p(il, x, w, dims, step, kv, buf, nth, rec):
    t = rdtsc()
    layers.rms_norm_rows(x, w.attn_norm[il], dims.eps, buf.h)
    rec[0, 0], rec[0, 1] = t, rdtsc()
    project_p(w.qkv[il], w, buf.h, (buf.q, buf.k, buf.v), nth, rec[1])
    t = rdtsc()
    q, k = dk._qkv_finish(il, w, dims, buf, True)
    rec[2, 0], rec[2, 1] = t, rdtsc()
    k_cache, v_cache, slots, tables = dk._layer_cache(il, w, step, kv)
    r = w.flags[il, dk.F_ROPE]
    dim, neox = step.rope_dims[r, 0], step.rope_dims[r, 1] != 0
    layers.rope_store_kv(
        q, k, buf.v, buf.cos[r], buf.sin[r], dim, neox, k_cache, v_cache, slots, buf.q, buf.k
    )
    if w.attn_temp[il, 0] != 0.0:
        dk._temperature(buf.q, step.positions, w.attn_temp[il, 0], w.attn_temp[il, 1])
    t2 = rdtsc()
    rec[3, 0], rec[3, 1] = rec[2, 1], t2
    window, cap = w.flags[il, dk.F_WINDOW], w.softcap[il]
    sinks = w.extras.sinks[il, :0]
    dk._attend(buf.q, k_cache, v_cache, step, tables, dims.attn_scale, window, cap, sinks, buf.att, nth)
    rec[4, 0], rec[4, 1] = t2, rdtsc()
    project_p(w.o[il], w, buf.att.reshape(x.shape[0], -1), (buf.o,), nth, rec[5])
    t = rdtsc()
    dk._residual(x, buf.o, w.flags[il, dk.F_POST_ATTN], w.post_attn_norm[il], dims.eps, buf.h)
    rec[6, 0], rec[6, 1] = t, rdtsc()
    layers.rms_norm_rows(x, w.ffn_norm[il], dims.eps, buf.h)
    rec[7, 0], rec[7, 1] = rec[6, 1], rdtsc()
    project_p(w.gate_up[il], w, buf.h, (buf.gate, buf.up), nth, rec[8])
    t = rdtsc()
    layers.swiglu_rows(buf.gate, buf.up, buf.act)
    rec[9, 0], rec[9, 1] = t, rdtsc()
    project_p(w.down[il], w, buf.act, (buf.down,), nth, rec[10])
    t = rdtsc()
    dk._residual(x, buf.down, w.flags[il, dk.F_POST_FFN], w.post_ffn_norm[il], dims.eps, buf.h)
    rec[11, 0], rec[11, 1] = t, rdtsc()


@njit(nogil=True)
def stack_p(x, w, dims, step, kv, nth, rec):
    half = max(1, step.rope_freqs.shape[1])
    buf = dk._buffers(x.shape[0], x.shape[1], dims, step.rope_dims.shape[0], half)
    dk._rotations(step, buf)
    for il in range(w.flags.shape[0]):
        layer_p(il, x, w, dims, step, kv, dk._views(buf, il, w, dims), nth, rec[il])
    return buf.q.size + buf.k.size + buf.v.size + buf.o.size + buf.gate.size + buf.up.size + buf.down.size


class Recorder:
    def __init__(self) -> None:
        self.rows: dict[int, list[np.ndarray]] = {}
        self.threads = 1

    def __call__(self, x: Any, w: Any, dims: Any, step: Any, kv: Any, nth: int) -> int:
        flags = w.flags
        if flags[:, [dk.F_BIAS, dk.F_QK_NORM, dk.F_EXPERTS, dk.F_PER_LAYER, dk.F_GELU]].any():
            raise SystemExit("profile_stack_sections: dense SwiGLU layers without biases or q/k norms only")
        if x.shape[0] != 1:  # the prompt: run it, record nothing
            return dk.decoder_stack(x, w, dims, step, kv, nth)
        rec = np.zeros((flags.shape[0], len(SECTIONS), COLS), np.int64)
        out = stack_p(x, w, dims, step, kv, nth, rec)
        self.rows.setdefault(nth, []).append(rec)
        return out


@njit
def _tsc() -> int:
    return rdtsc()


def tsc_per_us() -> float:
    _tsc()  # compiled before the clock starts
    t0, c0 = time.perf_counter(), _tsc()
    time.sleep(0.2)
    return (_tsc() - c0) / (time.perf_counter() - t0) / 1e6


def report(recs: list[np.ndarray], nth: int, per_us: float) -> None:
    r = np.stack(recs)  # (steps, layers, sections, COLS)
    dur = (r[..., 1] - r[..., 0]) / per_us
    best = dur.min(axis=0).sum(axis=0)  # per section: the layers' lowest times, summed
    print(f"\n{nth} thread(s), {len(recs)} steps; lowest per layer and section, summed over layers (us):")
    for s, name in enumerate(SECTIONS):
        line = f"  {name:11s} {best[s]:8.1f}"
        if s in LAUNCHES:
            line += _launch_detail(r[:, :, s], nth, per_us)
        print(line)
    print(f"  {'sum':11s} {best.sum():8.1f}   whole stack (lowest step): {dur.sum(axis=(1, 2)).min():.1f}")


def _launch_detail(r: np.ndarray, nth: int, per_us: float) -> str:
    """A launch's parts, each lowest per layer then summed: set-up (quantize, argvs), the threads'
    start delay, their busy time (summed over threads: the work), the span from the first start to the
    last end, the imbalance (last end - first end) and the wait after the last end (the join)."""

    def low(a: np.ndarray) -> float:
        return float((a / per_us).min(axis=0).sum())

    starts = np.stack([r[..., 3 + 2 * c] for c in range(nth)])
    ends = np.stack([r[..., 4 + 2 * c] for c in range(nth)])
    parts = [f"setup {low(r[..., 2] - r[..., 0]):6.1f}", f"start {low(starts.min(0) - r[..., 2]):5.1f}"]
    parts.append(f"work {low((ends - starts).sum(0)):7.1f}")
    parts.append(f"span {low(ends.max(0) - starts.min(0)):7.1f}")
    if nth > 1:
        parts.append(f"imbalance {low(ends.max(0) - ends.min(0)):6.1f}")
    parts.append(f"join {low(r[..., 1] - ends.max(0)):5.1f}")
    if nth > 1:  # a thread that found no piece left spends well under a microsecond
        parts.append(f"both worked {((ends - starts) / per_us > 2.0).all(0).mean():.2f}")
    return "   " + " | ".join(parts)


def profile_decode(description: str, patch: Callable[[Recorder], None], rec: Recorder, team: bool,
                   report_rows: Callable[[Any, int, float], None]) -> None:  # fmt: skip
    """Decode MODEL's tokens at each thread count, rounds alternating, with `patch(rec)` having put a
    recording copy of the stack in numba_stack's place; then report each count's rows."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model")
    ap.add_argument("-t", default="1,2")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    import numba

    from localllm.backends.threads import ModelGovernors
    from localllm.engine.engine import EngineConfig, LLMEngine
    from localllm.sampling_params import SamplingParams

    counts = [int(t) for t in a.t.split(",")]
    engine = LLMEngine(EngineConfig(model=a.model, threads=max(counts)))
    engine.backend.team_stack = team
    patch(rec)
    params = SamplingParams(temperature=0, max_tokens=a.n + 1, ignore_eos=True)
    for r in range(a.rounds + 1):
        for t in counts:
            engine.backend._governors = ModelGovernors(t, adaptive=False)
            engine.backend.threads = t
            numba.set_num_threads(t)
            engine.generate([[1, 2, 3, 4, 5]], params)
        if r == 0:
            rec.rows.clear()  # the first round compiles and warms up
    per_us = tsc_per_us()
    for t in counts:
        report_rows(rec.rows[t], t, per_us)


class Shim:
    """A kernels module as numba_stack sees it, with one of its functions replaced by a recorder."""

    def __init__(self, module: Any, name: str, rec: Recorder) -> None:
        self._module, self._name, self._rec = module, name, rec

    def __getattr__(self, name: str) -> Any:
        return self._rec if name == self._name else getattr(self._module, name)


def _patch(rec: Recorder) -> None:
    import localllm.backends.numba_stack as ns

    ns.dk = Shim(dk, "decoder_stack", rec)


def main() -> None:
    # (team off: this copy is of decoder_stack's path, a launch per projection)
    profile_decode(__doc__.splitlines()[0], _patch, Recorder(), False, report)


if __name__ == "__main__":
    main()
