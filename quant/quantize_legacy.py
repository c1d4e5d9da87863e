"""NumPy quantizers for ggml's legacy 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each `quantize_*` takes float32 blocks of shape (n_blocks, 32) and returns an array of the block structs
of quant/ggml.py, the same bytes as ggml's reference `quantize_row_*_ref` (what llama-quantize writes
for these types without an importance matrix).  Every step is one float32 operation in ggml's order and
C's float-to-int conversions (truncation, roundf) are reproduced, so the output is bit-exact; reordering
any product would break that.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .ggml import BLOCK_Q4_0, BLOCK_Q4_1, BLOCK_Q5_0, BLOCK_Q5_1, BLOCK_Q8_0

F32 = np.float32
_BIT_WEIGHTS = np.uint32(1) << np.arange(32, dtype=np.uint32)  # bit j of qh belongs to element j


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per block, the element of largest magnitude with its sign (the first one on ties, as ggml)."""
    index = np.abs(x).argmax(axis=-1)
    return np.take_along_axis(x, index[:, None], axis=-1)[:, 0]


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d is 0 (an all-zero block)."""
    out = np.zeros_like(d)
    np.divide(F32(1), d, out=out, where=d != 0)
    return out


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero, exactly (adding 0.5 could round 0.49999997 up)."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= F32(0.5)), v)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 16 -> (n, 16) bytes: element j in the low nibble, j + 16 in the high one."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _high_bits(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 32 -> (n,) uint32 whose bit j is the fifth bit of element j."""
    return ((q.astype(np.uint32) >> 4) & 1) @ _BIT_WEIGHTS


def _blocks(layout: np.dtype, n: int, **fields: np.ndarray) -> np.ndarray:
    out = np.zeros(n, dtype=layout)
    for name, value in fields.items():
        out[name] = value
    return out


def _symmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = signed absmax / -(levels/2), q = trunc(x/d + levels/2 + 0.5) capped at levels-1."""
    half = levels // 2
    d = _signed_absmax(x) / F32(-half)
    q = (x * _inverse(d)[:, None] + F32(half + 0.5)).astype(np.int8)
    return d, np.minimum(q, levels - 1)


def _affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: d = (max - min) / (levels-1), q = trunc((x - min)/d + 0.5), the min stored as m."""
    low, high = x.min(axis=-1), x.max(axis=-1)
    d = (high - low) / F32(levels - 1)
    q = ((x - low[:, None]) * _inverse(d)[:, None] + F32(0.5)).astype(np.int8)
    return d, low, np.minimum(q, levels - 1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 16)
    return _blocks(BLOCK_Q4_0, len(x), d=d, qs=_pack_nibbles(q))


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _affine(x, 16)
    return _blocks(BLOCK_Q4_1, len(x), d=d, m=low, qs=_pack_nibbles(q))


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 32)
    return _blocks(BLOCK_Q5_0, len(x), d=d, qh=_high_bits(q), qs=_pack_nibbles(q))


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, low, q = _affine(x, 32)
    return _blocks(BLOCK_Q5_1, len(x), d=d, m=low, qh=_high_bits(q), qs=_pack_nibbles(q))


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=-1) / F32(127)
    q = _roundf(x * _inverse(d)[:, None]).astype(np.int8)
    return _blocks(BLOCK_Q8_0, len(x), d=d, qs=q)


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": quantize_q4_0,
    "Q4_1": quantize_q4_1,
    "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1,
    "Q8_0": quantize_q8_0,
}
