"""One 64-row Q4_K tile in cache, one activation row: the fused decode kernel (kernels/matmul_row.py)
against its integer block sums alone, in ns per 32-block.  The difference is the float step's cost.
--q6: Q6_K's block sums instead, each form this CPU has (split + crumb sums and unpacked quads; with
VNNI the one- and two-row register forms).
Usage:  python scripts/bench_row_tile.py [--k 1536] [--calls 20000] [--q6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from localllm.kernels import matmul_row as mr
from localllm.kernels.packing import Q4_K
from localllm.kernels.packing import TILE_ROWS as R


@njit
def fused(n, dd, sm, qh, q3, xr, bits, dx, sx, acc, scratch):
    for _ in range(n):
        mr.row_nibbles(Q4_K, dd, sm, qh, q3, xr, xr, bits, dx, sx, acc, scratch)


@njit
def sums_only(n, q3, xr, s4):
    """The same block kernel the fused tile runs (the VNNI int32 one where the CPU has it)."""
    q, x, s = q3.ctypes.data, xr.ctypes.data, s4.ctypes.data
    for _ in range(n):
        for b in range(q3.shape[0]):
            if mr.Q4_K_INT32_SUMS:
                mr.q4_block_sums_vnni(q + b * 16 * R, x + b * 32, s, 0)
            else:
                mr._NIBBLE_BLOCK(q + b * 16 * R, x + b * 32, s, s + 2 * R)


@njit
def q6_split(n, qh2, q3, xr, s4):
    q, h, x, s = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, s4.ctypes.data
    for _ in range(n):
        for b in range(q3.shape[0]):
            mr._SPLIT_BLOCK(q + b * 16 * R, x + b * 32, s, s + 2 * R)
            mr._CRUMB_BLOCK(h + b * 8 * R, x + b * 32, s + 4 * R, s + 6 * R)


@njit
def q6_quads(n, qh2, q3, xr, s32, pairs):
    q, h, x, s, p, k = (
        q3.ctypes.data,
        qh2.ctypes.data,
        xr.ctypes.data,
        s32.ctypes.data,
        pairs.ctypes.data,
        xr.shape[1],
    )
    for _ in range(n):
        for b in range(q3.shape[0]):
            mr._Q6_UNPACK(q + b * 16 * R, h + b * 8 * R, p)
            for t in range(xr.shape[0]):
                mr._Q6_SUMS(p, x + t * k + b * 32, s)


@njit
def q6_registers(n, qh2, q3, xr, s32):
    q, h, x, s, k = q3.ctypes.data, qh2.ctypes.data, xr.ctypes.data, s32.ctypes.data, xr.shape[1]
    for _ in range(n):
        for b in range(q3.shape[0]):
            if xr.shape[0] == 2:
                mr.q6_block_sums2_vnni(q + b * 16 * R, h + b * 8 * R, x + b * 32, x + k + b * 32, s)
            else:
                mr.q6_block_sums_vnni(q + b * 16 * R, h + b * 8 * R, x + b * 32, s)


def q6_runs(k: int, rng: np.random.Generator) -> tuple[dict, int]:
    nb = k // 32
    q3, qh2 = (rng.integers(0, 256, (nb, m, R), dtype=np.uint8) for m in (16, 8))
    x1, x2 = rng.integers(-127, 127, (1, k)).astype(np.int8), rng.integers(-127, 127, (2, k)).astype(np.int8)
    s4, s32, pairs = np.zeros((8, R), np.int16), np.zeros((4, R), np.int32), np.zeros(2048, np.uint8)
    runs = {
        "split+crumb, 1 row": lambda n: q6_split(n, qh2, q3, x1, s4),
        "quads, 2 rows": lambda n: q6_quads(n, qh2, q3, x2, s32, pairs),
    }
    if mr.Q6_VNNI_ROWS:
        runs["registers, 1 row"] = lambda n: q6_registers(n, qh2, q3, x1, s32)
        runs["registers, 2 rows"] = lambda n: q6_registers(n, qh2, q3, x2, s32)
    return runs, q3.nbytes + qh2.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--q6", action="store_true", help="Q6_K's block sums")
    a = ap.parse_args()
    if a.q6:
        runs, nbytes = q6_runs(a.k, np.random.default_rng(0))
        time_runs(runs, a.calls, a.k // 32, nbytes)
        return
    nb, rng = a.k // 32, np.random.default_rng(0)
    q3 = rng.integers(0, 256, (nb, 16, R), dtype=np.uint8)
    dd = rng.integers(0x3000, 0x3400, (nb // 8, 2, R)).astype(np.uint16)
    sm = rng.integers(0, 63, (nb, 2, R)).astype(np.uint8)
    qh = np.zeros((0, 2, R), np.uint16)
    xr = rng.integers(-127, 127, (1, a.k)).astype(np.int8)
    bits = np.zeros((1, 0), np.int16)
    dx, sx = rng.random((1, nb)).astype(np.float32), rng.random((1, nb)).astype(np.float32)
    acc, s4 = np.zeros((1, R), np.float32), np.zeros((4, R), np.int16)
    scratch = np.zeros(mr.SUPER_BYTES, np.uint8)
    runs = {
        "fused tile": lambda n: fused(n, dd, sm, qh, q3, xr, bits, dx, sx, acc, scratch),
        "integer sums only": lambda n: sums_only(n, q3, xr, s4),
    }
    time_runs(runs, a.calls, nb, q3.nbytes)


def time_runs(runs: dict, calls: int, nb: int, nbytes: int) -> None:
    for run in runs.values():
        run(10)  # compile
    for name, run in [*runs.items(), *runs.items()]:
        t0 = time.perf_counter()
        run(calls)
        per_tile = (time.perf_counter() - t0) / calls
        rate = nbytes / per_tile / 1e9
        print(f"{name:18s} {per_tile * 1e9 / nb:6.1f} ns/block  {rate:6.1f} GB/s of quants")


if __name__ == "__main__":
    main()
