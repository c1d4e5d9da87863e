"""What a quads-native weight layout could save the AVX2 one-row (decode) Q4 kernels: a design
measurement, not a kernel in use.

Today's packed nibble layout (packing.py: byte j of a block's 64 rows contiguous) feeds the direct
kernel `q4_block_sums_avx2`, which spends its shuffles pairing each row's bytes with the activations.
A layout with each row's bytes in groups of four, 8 rows to a 32-byte vector (what llama.cpp's repack
buffer types and simd_x86_quads' scratch use), needs no shuffles: `q4_quad_sums_avx2` over blocks that
are already quads is its integer cost (an upper bound: quads hold one value a byte, twice the bytes of
nibbles).  The third figure is unpack-then-sum per block, today's Q6_K one-row path.  Rounds alternate
the three in one process, weights in L2 (compute) and, for the direct kernel and the whole matmul,
streamed from memory; figures are ns per 32-block of 64 rows (best of each round, median of rounds).

    python scripts/bench_q4_layout.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit

from localllm.kernels.simd_x86 import HAVE_AVX2, q4_block_sums_avx2
from localllm.kernels.simd_x86_quads import (
    QUADS_BYTES_AVX2,
    q4_quad_sums_avx2,
    q4_unpack_quads_avx2,
)

BLOCK = 16 * 64  # packed bytes of one 32-block of a 64-row tile


@njit(cache=True)
def direct(q, x, s, reps):
    qa, xa, sa = q.ctypes.data, x.ctypes.data, s.ctypes.data
    for _ in range(reps):
        for b in range(q.size // BLOCK):
            q4_block_sums_avx2(qa + b * BLOCK, xa + (b % 64) * 32, sa, sa + 128)


@njit(cache=True)
def pre_quads(p, x, s, reps):
    pa, xa, sa = p.ctypes.data, x.ctypes.data, s.ctypes.data
    for _ in range(reps):
        for b in range(p.size // QUADS_BYTES_AVX2):
            q4_quad_sums_avx2(pa + b * QUADS_BYTES_AVX2, xa + (b % 64) * 32, sa)


@njit(cache=True)
def unpack_then_sum(q, x, s, scratch, reps):
    qa, xa, sa, pa = q.ctypes.data, x.ctypes.data, s.ctypes.data, scratch.ctypes.data
    for _ in range(reps):
        for b in range(q.size // BLOCK):
            q4_unpack_quads_avx2(qa + b * BLOCK, 0, pa)
            q4_quad_sums_avx2(pa, xa + (b % 64) * 32, sa)


def _ns_per_block(fn, args: tuple, blocks: int, reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*args, reps)
        best = min(best, time.perf_counter() - t0)
    return best / (blocks * reps) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not HAVE_AVX2:
        raise SystemExit("needs AVX2")
    rng = np.random.default_rng(0)
    x = rng.integers(-127, 128, 64 * 32, dtype=np.int8)
    s, scratch = np.zeros(256, np.int32), np.zeros(QUADS_BYTES_AVX2, np.uint8)
    l2_blocks, big_blocks = 192, 64 * 1024  # 192 KiB of nibbles (384 KiB as quads); 64 MiB
    q_l2 = rng.integers(0, 256, l2_blocks * BLOCK, dtype=np.uint8)
    p_l2 = rng.integers(0, 16, l2_blocks * QUADS_BYTES_AVX2, dtype=np.uint8)
    q_big = rng.integers(0, 256, big_blocks * BLOCK, dtype=np.uint8)
    cases = {
        "direct (today's layout), L2": (direct, (q_l2, x, s), l2_blocks, 200),
        "quads already (a quads-native layout), L2": (pre_quads, (p_l2, x, s), l2_blocks, 200),
        "unpack then quads, L2": (unpack_then_sum, (q_l2, x, s, scratch), l2_blocks, 200),
        "direct (today's layout), streamed 64 MiB": (direct, (q_big, x, s), big_blocks, 1),
    }
    figures: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, fargs, blocks, reps) in cases.items():
            figures[name].append(_ns_per_block(fn, fargs, blocks, reps))
    for name, values in figures.items():
        gbs = BLOCK / statistics.median(values)
        print(f"{name:45s} {statistics.median(values):7.1f} ns/block ({min(values):.1f}-{max(values):.1f})"
              f"  {gbs:5.1f} GB/s of nibbles")  # fmt: skip


if __name__ == "__main__":
    main()
