"""One 64-row Q4_K tile in cache, one activation row: the fused decode kernel (kernels/matmul_row.py)
against its integer block sums alone, in ns per 32-block.  The difference is the float step's cost.
Usage:  python scripts/bench_row_tile.py [--k 1536] [--calls 20000]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
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
    for run in runs.values():
        run(10)  # compile
    for name, run in [*runs.items(), *runs.items()]:
        t0 = time.perf_counter()
        run(a.calls)
        per_tile = (time.perf_counter() - t0) / a.calls
        rate = q3.nbytes / per_tile / 1e9
        print(f"{name:18s} {per_tile * 1e9 / nb:6.1f} ns/block  {rate:6.1f} GB/s of quants")


if __name__ == "__main__":
    main()
