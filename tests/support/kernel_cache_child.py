"""Child process of test_kernel_cache.py: integer matmuls of each tile kernel, saved bit for bit.

Run as `python kernel_cache_child.py OUT.npz` with NUMBA_CACHE_DIR set: the kernels are compiled
afresh into an empty cache dir, or loaded from a warm one, and the two runs must agree exactly.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np
from gguf import GGMLQuantizationType as T
from random_weights import random_weight

from localllm.kernels import matmul
from localllm.kernels.quantize_act import quantize_rows

# One kind per tile kernel and high-bit variant: tile_nibbles (4-bit, 5-bit), tile_q6_k, tile_q8_0.
KINDS = ("Q4_1", "Q5_0", "Q6_K", "Q8_0")
# A lone row, the direct kernel's chunk, a chunk unpacked once for many rows, and several chunks.
ROWS = (1, 3, 16, 21, 40)


def outputs() -> dict[str, np.ndarray]:
    out = {}
    for name in KINDS:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        w = matmul.prepare_weight(random_weight(rng, name, 136, 512), T[name])
        for t in ROWS:
            x = (rng.standard_normal((t, 512)) * 4).astype(np.float32)
            for nth in (1, 2):  # the serial and the parallel launcher
                out[f"{name}-{t}-{nth}"] = matmul.linear(x, w, nth=nth)
    x = (np.random.default_rng(0).standard_normal((5, 512)) * 4).astype(np.float32)
    for i, a in enumerate(quantize_rows(x)):
        out[f"quantize_rows-{i}"] = a
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **outputs())
