"""NumPy quantizer for MXFP4 (32 E2M1 values sharing one E8M0 exponent), the bytes of ggml's
`quantize_row_mxfp4_ref`: the exponent is floor(log2(max|x|)) - 2 (so the largest value lands near
E2M1's top magnitude 6), and each element takes the code nearest to x / scale, the first on ties.
"""

from __future__ import annotations

import numpy as np

from .ggml import BLOCK_MXFP4, MXFP4_VALUES, e8m0_half

F32 = np.float32
_SUB_BLOCKS = 1 << 14  # blocks per pass: the (blocks, 32, 16) error table stays ~32 MB


def _exponent(x: np.ndarray) -> np.ndarray:
    """(n, 32) float32 -> (n,) E8M0 bytes; 0 for an all-zero block (as ggml)."""
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - F32(2) + F32(127), F32(0))
    return e.astype(np.int32).astype(np.uint8)


def _codes(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The code of each element: argmin |value * d - x| over the 16 codes (first on ties)."""
    grid = d[:, None, None] * MXFP4_VALUES.astype(F32)[None, None, :]
    return np.abs(grid - x[:, :, None]).argmin(axis=-1).astype(np.uint8)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """float32 blocks (n, 32) -> (n,) BLOCK_MXFP4 structs."""
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.zeros(len(x), dtype=BLOCK_MXFP4)
    for s in range(0, len(x), _SUB_BLOCKS):
        part = x[s : s + _SUB_BLOCKS]
        e = _exponent(part)
        q = _codes(part, e8m0_half(e))
        out["e"][s : s + _SUB_BLOCKS] = e
        out["qs"][s : s + _SUB_BLOCKS] = q[:, :16] | (q[:, 16:] << 4)
    return out


QUANTIZERS = {"MXFP4": quantize_mxfp4}
