"""Random weights of any GGML type for kernel tests (test_kernels.py and kernel_cache_child.py)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import quantize as gguf_quantize

from localllm.quant.ggml import BLOCK_KERNELS

T = gguf.GGMLQuantizationType
GGUF_QUANTIZABLE = {"BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}


def random_weight(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """An (n, k) weight of type `name`: gguf's quantizer where it has one, else random block
    bytes with sane fp16 scales (K-quants)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if name == "F32":
        return w
    if name == "F16":
        return w.astype(np.float16)
    if name in GGUF_QUANTIZABLE:
        return gguf_quantize(w, T[name])
    layout = BLOCK_KERNELS[name][0]
    raw = rng.integers(0, 256, size=(n, k // 256 * layout.itemsize), dtype=np.uint8)
    blocks = raw.view(layout)
    for field in layout.names:
        if layout[field] == np.dtype("<f2"):
            blocks[field] = (rng.standard_normal(blocks[field].shape) * 0.05).astype(np.float16)
    return raw
