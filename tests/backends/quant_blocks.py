"""Random GGUF blocks of every type the torch backend keeps quantized: every quant bit pattern and every
packed 6-bit scale occurs, with fp16 scales (and MXFP4's exponents) drawn from a sane range (random
bytes there would make infinities and NaNs, which compare badly and no quantizer writes)."""

from __future__ import annotations

import numpy as np

from localllm.quant import QUANT_BY_NAME
from localllm.quant.ggml import BLOCK_KERNELS

SCALE_FIELDS = ("d", "m", "dmin")


def random_rows(qtype: str, n: int, k: int, seed: int = 0) -> tuple[int, np.ndarray]:
    """(ggml type id, raw rows (n, row bytes) as GGUFReader gives a quantized matrix)."""
    layout, block_size, _ = BLOCK_KERNELS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block_size * layout.itemsize), dtype=np.uint8)
    blocks = raw.view(layout)
    for name in SCALE_FIELDS:
        if name in layout.names:
            blocks[name] = rng.uniform(-0.02, 0.02, size=blocks.shape).astype(np.float16)
    if "e" in layout.names:  # MXFP4's E8M0 exponents: scales 2^-16..2^12 (255 overflows; test_torch_gptoss
        blocks["e"] = rng.integers(112, 141, size=blocks.shape)  # dequantizes every exponent)
    return QUANT_BY_NAME[qtype].ggml_type, raw
