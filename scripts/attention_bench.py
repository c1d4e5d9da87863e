"""The paged attention kernel against an older version of it (git --ref), alternating rounds in one run.

    python scripts/attention_bench.py [--ref main] [--rounds 3] [-t 1,2] [--cache f16,f32]

The old kernels/attention.py (and attention_tiles.py, where REF has it) is read with `git show`,
written to a folder in this machine's temp dir and imported as a sibling of localllm.kernels.attention
(its other relative imports resolve to today's kv.py, simd.py, ...). Each case is one sequence
whose last Q queries see its N cached keys (a prefill chunk at depth N, or a decode for Q = 1),
every query head. A round calls the old and the new kernel in turn for --budget seconds and keeps
each one's best time (one thread: its CPU time). The table has GMAC/s from the best of all rounds
(a multiply-add of the scores or of the weighted sum of values is one MAC), their old/new ratio,
and the range of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

from localllm.kernels import attention, layers

SHAPES = {"SmolLM2 9/3 D64": (9, 3, 64), "Qwen2.5-0.5B 14/2 D64": (14, 2, 64)}
CASES = [(16, 256), (16, 1024), (16, 4096), (1, 4096)]  # (queries, keys)
BLOCK = 16


def _import_source(name: str, src: str, folder: Path):
    """Module localllm.kernels.<name> from source text src, written to folder (Numba caches beside it)."""
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"localllm.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_ref(ref: str):
    """kernels/attention.py as of git ref `ref`, as module localllm.kernels._attention_ref (with that
    revision's attention_tiles.py where it has one; the other kernels are today's)."""
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.check_output(["git", "rev-parse", "--short", ref], cwd=root, text=True).strip()

    def show(path: str) -> str | None:
        done = subprocess.run(["git", "show", f"{sha}:{path}"], cwd=root, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    folder = Path(tempfile.gettempdir()) / f"attention_bench_{sha}"
    folder.mkdir(exist_ok=True)
    src = show("kernels/attention.py")
    tiles = show("kernels/attention_tiles.py")
    if tiles is not None:
        _import_source("_attention_tiles_ref", tiles, folder)
        src = src.replace("from .attention_tiles import", "from ._attention_tiles_ref import")
    return _import_source("_attention_ref", src, folder), sha


def make_case(heads: int, kvh: int, d: int, nq: int, n: int, cache: str, rng: np.random.Generator):
    """Arguments of paged_attention_serial (without out) and the case's MACs."""
    nb = (n + BLOCK - 1) // BLOCK
    dtype = {"f32": np.float32, "f16": np.uint16}[cache]
    kc, vc = np.zeros((2, nb + 1, BLOCK, kvh, d), dtype)
    k, v = rng.standard_normal((2, n, kvh, d)).astype(np.float32)
    table = rng.permutation(nb + 1)[:nb].astype(np.int64)
    slots = table[np.arange(n) // BLOCK] * BLOCK + np.arange(n) % BLOCK
    layers.store_kv_rows(kc, vc, k, v, slots)
    q = rng.standard_normal((nq, heads, d)).astype(np.float32)
    qsl, ctx = np.array([0, nq], np.int64), np.array([n], np.int64)
    visible = sum(n - nq + 1 + i for i in range(nq))
    return (q, kc, vc, qsl, ctx, table[None], 0.125, 0, 0.0), 2 * heads * d * visible


def _caller(module, args: tuple, out: np.ndarray, threads: int):
    if threads == 1:
        return lambda: module.paged_attention_serial(*args, out)
    return lambda: module.paged_attention_par(*args, out, threads)


def one_round(calls: list, threads: int, budget: float) -> list[float]:
    """Each call's best time over alternating calls (old, new, old, ...) for about `budget` seconds;
    one thread: the thread's CPU time, which a busy machine's other processes do not inflate."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    best, start = [float("inf")] * len(calls), time.perf_counter()
    while time.perf_counter() - start < budget:
        for i, call in enumerate(calls):
            t = clock()
            call()
            best[i] = min(best[i], clock() - t)
    return best


def run_case(ref, shape, nq: int, n: int, cache: str, threads: int, rounds: int, budget: float) -> str:
    args, macs = make_case(*shape, nq, n, cache, np.random.default_rng(n + nq))
    outs = [np.empty_like(args[0]) for _ in range(2)]
    calls = [_caller(m, args, o, threads) for m, o in zip((ref, attention), outs, strict=True)]
    for call in calls:
        call()
    times = [one_round(calls, threads, budget) for _ in range(rounds)]
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    old, new = min(t[0] for t in times), min(t[1] for t in times)
    ratios = sorted(t[0] / t[1] for t in times)
    cells = [f"{nq} x {n:,}", cache, str(threads), f"{macs / old / 1e9:.1f}", f"{macs / new / 1e9:.1f}"]
    cells += [f"**{old / new:.2f}x**", f"{ratios[0]:.2f}-{ratios[-1]:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="git revision of the old kernel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of alternating calls a round")
    ap.add_argument("-t", default="1,2", help="thread counts")
    ap.add_argument("--cache", default="f16,f32", help="KV cache types")
    ap.add_argument("--shape", choices=list(SHAPES), action="append", help="default: all")
    args = ap.parse_args()
    ref, sha = load_ref(args.ref)
    numba.set_num_threads(max(int(t) for t in args.t.split(",")))
    print(f"old: {args.ref} ({sha}); load average {os.getloadavg()[0]:.1f}", flush=True)
    for name in args.shape or SHAPES:
        print(f"\n{name}\n")
        print("| queries x keys | cache | threads | old GMAC/s | new GMAC/s | old/new (best) | range |")
        print("|---|---|---|---|---|---|---|", flush=True)
        for nq, n in CASES:
            for cache in args.cache.split(","):
                for t in args.t.split(","):
                    print(
                        run_case(ref, SHAPES[name], nq, n, cache, int(t), args.rounds, args.budget),
                        flush=True,
                    )
    print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
