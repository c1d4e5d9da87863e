"""Single-row (decode) matmul throughput per weight type and shape: GB/s of packed weight bytes.

Streaming cases cycle through enough copies of a weight to exceed the L3 cache, so every call reads
its weight from memory as decode does; "l2" and "tiny" repeat one weight that stays in cache (the
compute rate, and the fixed cost of a call).  Each figure is the fastest sweep over the copies (the
least disturbed on a shared machine), with the median beside it.  --precise times linear_precise,
the path output projections take (Q8_0: int16 activations), instead of linear; --cpu-time times one
thread by its CPU time (a process that another holds off the core is not charged for the wait);
--read adds a plain one-core read of the same bytes (numpy), the memory ceiling of a streaming case.
Usage:
    python scripts/gemv_bench.py [--threads 1 2] [--cases big moe l2 gemma] [--reps 150] [--mmap]
        [--precise] [--cpu-time] [--read] [--rows T]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numba
import numpy as np

from localllm.kernels import matmul
from localllm.quant.types import QUANT_TYPES

GGML = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
CASES = {  # (type, rows, columns): Qwen2.5-1.5B's Q4_K_M matrices, the tiny qwen3moe's experts, ...
    "qwen15": [("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q4_K", 1536, 1536), ("Q6_K", 151936, 1536)],
    "qwen05": [("Q5_0", 4864, 896), ("Q6_K", 896, 4864), ("Q5_0", 896, 896), ("Q8_0", 32768, 896)],
    "moe": [("Q4_0", 768, 1024), ("Q4_0", 1024, 768), ("Q4_1", 768, 1024), ("Q4_0", 4096, 1024)],
    "big": [("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q4_0", 4096, 1024)],
    # the tiny-arch bench files' dense layer (hidden 1024, FFN 2816; Q6_K: Q4_K_M's down and output)
    "dense1k": [("Q4_K", 1024, 1024), ("Q4_K", 256, 1024), ("Q4_K", 2816, 1024), ("Q6_K", 1024, 2816)],
    # the same bytes as 64, 16 and 4 tiles: a tile's fixed cost (ktiles_l2 in cache, ktiles streamed)
    "ktiles": [("Q4_K", 65536, 256), ("Q4_K", 16384, 1024), ("Q4_K", 4096, 4096)],
    "ktiles_l2": [("Q4_K", 4096, 256), ("Q4_K", 1024, 1024), ("Q4_K", 256, 4096)],
    "gptoss": [("Q8_0", 4096, 2880), ("MXFP4", 2880, 2880)],  # gpt-oss-20b: attention q (Q8_0), an expert
    "tiny": [("Q4_0", 64, 1024), ("Q4_0", 256, 1024), ("Q4_0", 768, 1024), ("Q4_0", 2048, 1024)],
    "l2": [("Q4_K", 512, 1536), ("Q6_K", 128, 8960), ("Q6_K", 512, 1536), ("Q4_0", 768, 1024)],
    "all": [(t, 4096, 1024) for t in GGML],
    "gemma": [("Q8_0", 262144, 640)],  # Gemma 3's tied output projection (token_embd), ~178 MB
}
IN_CACHE = ("l2", "tiny", "ktiles_l2")
STREAM_BYTES = 96 << 20  # > L3


def random_raw(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """Random block bytes (the fp16 scales too: the speed does not depend on their values)."""
    qt = QUANT_TYPES[GGML[name]]
    return rng.integers(0, 256, size=(n, k // qt.block_size * qt.type_size), dtype=np.uint8)


def _mapped(w: matmul.PackedWeight, i: int) -> matmul.PackedWeight:
    path = f"/tmp/gemv_bench_{i}.bin"
    w.buf.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return dataclasses.replace(w, buf=mm, addr=mm.ctypes.data)


def _sweeps(
    ws: list, x: np.ndarray, out: np.ndarray, nth: int, count: int, args: argparse.Namespace
) -> list[float]:
    """Seconds per call of `count` sweeps, each calling every copy once."""
    clock = time.thread_time if args.cpu_time else time.perf_counter
    times = []
    for _ in range(count):
        t0 = clock()
        for w in ws:
            if args.precise:
                matmul.linear_precise(x, w, nth)
            else:
                matmul.linear(x, w, nth, out)
        times.append((clock() - t0) / len(ws))
    return times


def read_rate(ws: list, count: int) -> float:
    """GB/s of the fastest of `count` plain reads (numpy's max, one thread) of every copy's bytes."""
    best = float("inf")
    for _ in range(count):
        t0 = time.perf_counter()
        for w in ws:
            w.buf.view(np.uint64).max()
        best = min(best, (time.perf_counter() - t0) / len(ws))
    return ws[0].nbytes / best / 1e9


def bench_case(name: str, n: int, k: int, args: argparse.Namespace, stream_bytes: int) -> None:
    rng = np.random.default_rng(0)
    w0 = matmul.prepare_weight(random_raw(rng, name, n, k), GGML[name])
    copies = max(1, min(64, stream_bytes // w0.nbytes))
    ws = [w0] + [matmul.prepare_weight(random_raw(rng, name, n, k), GGML[name]) for _ in range(copies - 1)]
    if args.mmap:  # as the backend's weight cache gives them: page-cache pages of a file
        ws = [_mapped(w, i) for i, w in enumerate(ws)]
    x = rng.standard_normal((args.rows, k)).astype(np.float32)
    out = np.empty((args.rows, n), np.float32)
    line = f"{name:5s} {n:6d} x {k:5d} {w0.nbytes / 2**20:7.2f} MiB x{copies:<3d}"
    for nth in args.threads:
        numba.set_num_threads(min(nth, numba.config.NUMBA_NUM_THREADS))  # as the backend sets it
        _sweeps(ws, x, out, nth, 1, args)  # warm-up (and compilation)
        times = _sweeps(ws, x, out, nth, max(3, args.reps // copies), args)
        best, med = w0.nbytes / min(times) / 1e9, w0.nbytes / float(np.median(times)) / 1e9
        line += f" | {nth}t {min(times) * 1e6:8.1f} us {best:5.1f} GB/s (median {med:5.1f})"
    if args.read:
        line += f" | read {read_rate(ws, max(3, args.reps // copies)):5.1f} GB/s"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="+", default=["qwen15", "moe"], choices=sorted(CASES))
    ap.add_argument("--mmap", action="store_true", help="weights memory-mapped from files")
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--rows", type=int, default=1, help="activation rows (sequences decoding together)")
    ap.add_argument("--precise", action="store_true", help="time linear_precise (output projections)")
    ap.add_argument("--cpu-time", action="store_true", help="time one thread by its CPU time")
    ap.add_argument("--read", action="store_true", help="also a plain one-core read of the same bytes")
    args = ap.parse_args()
    if args.cpu_time and args.threads != [1]:
        ap.error("--cpu-time times the calling thread only: use it with --threads 1")
    for c in args.cases:
        for name, n, k in CASES[c]:
            bench_case(name, n, k, args, 0 if c in IN_CACHE else STREAM_BYTES)


if __name__ == "__main__":
    main()
