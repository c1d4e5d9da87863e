"""Micro-benchmark of the Numba matmul kernels on the real SmolLM2-135M weights (not a test).

    python bench/kernels_micro.py [--model PATH] [--threads 2] [--reps 30]

Prints, per matrix of layer 0 and the output projection: decode-shaped (T=1) time, GB/s of weight
bytes and GFLOP/s; prefill-shaped (T=512) time and GFLOP/s.  Then a whole decode-token estimate
streaming every layer's matrices plus the output (as a real step would, so weights come from DRAM,
not cache), the integer-vs-float crossover in T, and the fixed cost of one kernel call.
Times are the minimum over repetitions (other processes add noise, never remove time); medians
are shown where the spread matters.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np

from localllm.kernels import matmul
from localllm.kernels.packing import PackedWeight
from localllm.loading.file import GGUFFile

MATRICES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def timeit(fn, reps: int) -> tuple[float, float]:
    """(min, median) seconds of fn() over reps calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def load(path: Path) -> tuple[GGUFFile, dict[str, PackedWeight]]:
    g = GGUFFile.open(path, Path("/tmp/localllm-bench-index"))
    names = [f"blk.{il}.{m}.weight" for il in range(int(g.arch_get("block_count"))) for m in MATRICES]
    names.append("token_embd.weight")
    return g, {n: matmul.prepare_weight(g.raw(n), g.tensors[n].ggml_type) for n in names}


def per_matrix(weights: dict[str, PackedWeight], threads: int, reps: int) -> None:
    print(
        f"{'matrix':26s} {'type':5s} {'N x K':>12s} | {'T=1 us':>8s} {'GB/s':>6s} {'GFLOP/s':>7s}"
        f" | {'T=512 ms':>8s} {'GFLOP/s':>7s}"
    )
    rng = np.random.default_rng(0)
    for name in [f"blk.0.{m}.weight" for m in MATRICES] + ["token_embd.weight"]:
        w = weights[name]
        x1 = rng.standard_normal((1, w.k)).astype(np.float32)
        xp = rng.standard_normal((512, w.k)).astype(np.float32)
        t1, _ = timeit(lambda w=w, x=x1: matmul.linear(x, w, threads), reps)
        tp, _ = timeit(lambda w=w, x=xp: matmul.linear(x, w, threads), max(2, reps // 10))
        flop = 2.0 * w.n * w.k
        qname = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"][w.kind] if w.lane else "row"
        print(
            f"{name:26s} {qname:5s} {w.n:>5d} x {w.k:<5d} | {t1 * 1e6:8.1f} {w.nbytes / t1 / 1e9:6.1f}"
            f" {flop / t1 / 1e9:7.1f} | {tp * 1e3:8.2f} {flop * 512 / tp / 1e9:7.1f}"
        )


def decode_token(weights: dict[str, PackedWeight], threads: int, reps: int) -> None:
    """All matrices of all layers + output at T=1, in model order: the linear part of a token."""
    order = list(weights)  # layers in order, then the output projection
    xs = {w.k: np.ones((1, w.k), np.float32) for w in weights.values()}
    total_bytes = sum(w.nbytes for w in weights.values())

    def step():
        for name in order:
            w = weights[name]
            matmul.linear(xs[w.k], w, threads)

    tmin, tmed = timeit(step, reps)
    print(
        f"\ndecode token, all {len(order)} matrices: min {tmin * 1e3:.2f} ms, median {tmed * 1e3:.2f} ms"
        f" ({total_bytes / tmin / 1e9:.1f} GB/s of {total_bytes / 1e6:.1f} MB)"
        f" -> {1 / tmin:.0f} tok/s upper bound from the matmuls"
    )
    layers_only = [n for n in order if n.startswith("blk.")]
    lbytes = sum(weights[n].nbytes for n in layers_only)
    out = weights["token_embd.weight"]
    t_out, _ = timeit(lambda: matmul.linear(xs[out.k], out, threads), reps)
    print(
        f"  of which output projection {t_out * 1e3:.2f} ms ({out.nbytes / t_out / 1e9:.1f} GB/s hot),"
        f" layers ~{(tmin - t_out) * 1e3:.2f} ms ({lbytes / (tmin - t_out) / 1e9:.1f} GB/s)"
    )


def decode_token_fused(weights: dict[str, PackedWeight], threads: int, reps: int) -> None:
    """The same with q/k/v and gate/up as one launch each (NumbaBackend.linear_many): 4 launches
    per layer instead of 7."""
    n_layers = sum(1 for n in weights if n.endswith("attn_q.weight"))
    layers = []
    for il in range(n_layers):
        w = {m: weights[f"blk.{il}.{m}.weight"] for m in MATRICES}
        qkv = matmul.WeightGroup.of((w["attn_q"], w["attn_k"], w["attn_v"]))
        gate_up = matmul.WeightGroup.of((w["ffn_gate"], w["ffn_up"]))
        layers.append((qkv, w["attn_output"], gate_up, w["ffn_down"]))
    out = weights["token_embd.weight"]
    x576, x1536 = np.ones((1, 576), np.float32), np.ones((1, 1536), np.float32)

    def step():
        for qkv, wo, gate_up, down in layers:
            matmul.linear_group(x576, qkv, threads)
            matmul.linear(x576, wo, threads)
            matmul.linear_group(x576, gate_up, threads)
            matmul.linear(x1536, down, threads)
        matmul.linear(x576, out, threads)

    tmin, tmed = timeit(step, reps)
    total = sum(w.nbytes for w in weights.values())
    print(
        f"decode token, fused launches: min {tmin * 1e3:.2f} ms, median {tmed * 1e3:.2f} ms"
        f" ({total / tmin / 1e9:.1f} GB/s) -> {1 / tmin:.0f} tok/s upper bound from the matmuls"
    )


def prefill_estimate(weights: dict[str, PackedWeight], threads: int) -> None:
    """All layer matrices at T=512 (the output projection runs only for the last token)."""
    xs = {w.k: np.ones((512, w.k), np.float32) for w in weights.values()}
    names = [n for n in weights if n.startswith("blk.")]
    t0 = time.perf_counter()
    for n in names:
        matmul.linear(xs[weights[n].k], weights[n], threads)
    dt = time.perf_counter() - t0
    flop = sum(2.0 * weights[n].n * weights[n].k * 512 for n in names)
    print(
        f"\nprefill 512 tokens, all layer matrices: {dt * 1e3:.0f} ms, {flop / dt / 1e9:.1f} GFLOP/s"
        f" -> {512 / dt:.0f} tok/s upper bound from the matmuls"
    )


def crossover(weights: dict[str, PackedWeight], threads: int, reps: int) -> None:
    """Integer vs float path on ffn_gate (both forced), to place matmul.INT_PATH_MAX_T."""
    w = weights["blk.0.ffn_gate.weight"]
    print(f"\nint vs float path, {w.n} x {w.k} (T: int us / float us)")
    fi, ff = w.kernels
    for t in (1, 2, 4, 16, 64, 512):
        x = np.ones((t, w.k), np.float32)
        y = np.empty((t, w.n), np.float32)
        args = (w.addr, w.nbytes, w.n, w.k, x, y, threads)
        ti, _ = timeit(lambda args=args: matmul.launch_linear(fi, w.gemm, True, *args), max(2, reps // t))
        tf, _ = timeit(lambda args=args: matmul.launch_linear(ff, w.gemm, False, *args), max(2, reps // t))
        print(f"  T={t:2d}: {ti * 1e6:8.1f} / {tf * 1e6:8.1f}")


def overhead(weights: dict[str, PackedWeight], threads: int, reps: int) -> None:
    """Fixed cost per call: the smallest matrix, serial and parallel launch."""
    w = weights["blk.0.attn_k.weight"]
    x = np.ones((1, w.k), np.float32)
    y = np.empty((1, w.n), np.float32)
    fi = w.kernels[0]
    args = (w.addr, w.nbytes, w.n, w.k, x, y)
    ts, tsm = timeit(lambda: matmul.launch_linear_serial(fi, w.gemm, True, *args), reps * 10)
    tp, tpm = timeit(lambda: matmul.launch_linear(fi, w.gemm, True, *args, threads), reps * 10)
    tl, tlm = timeit(lambda: matmul.linear(x, w, threads), reps * 10)
    print(
        f"\n{w.n} x {w.k} at T=1: serial {ts * 1e6:.1f} us (median {tsm * 1e6:.1f}),"
        f" parallel {tp * 1e6:.1f} us (median {tpm * 1e6:.1f}), via linear() {tl * 1e6:.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/work/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    t0 = time.perf_counter()
    _, weights = load(args.model)
    print(
        f"loaded and packed {len(weights)} matrices in {time.perf_counter() - t0:.1f} s,"
        f" {args.threads} threads\n"
    )
    per_matrix(weights, args.threads, args.reps)
    decode_token(weights, args.threads, max(5, args.reps // 3))
    decode_token_fused(weights, args.threads, max(5, args.reps // 3))
    prefill_estimate(weights, args.threads)
    crossover(weights, args.threads, args.reps)
    overhead(weights, args.threads, args.reps)


if __name__ == "__main__":
    main()
