"""GGML block layouts and vectorised NumPy dequantizers.

Each quantized type is described by a NumPy structured dtype that mirrors the C struct in ggml
(``block_q4_0`` and friends), so a contiguous run of bytes can be *viewed* as an array of blocks
without copying.  Every ``dequant_*`` function takes such an array of blocks, shape ``(..., n_blocks)``,
and returns float32 of shape ``(..., n_blocks, block_size)``.

The float arithmetic follows ggml's reference order (``dequantize_row_*`` in ggml-quants.c): scales
are formed first (``d * sc``), then multiplied by the integer quant, then the min is subtracted.  Each
step is a single float32 operation, so results are bit-for-bit identical to ggml and to
``gguf.quants.dequantize``; reordering any product would break that.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .types import QK_K, QUANT_BY_NAME

K_SCALE_SIZE = 12  # bytes of packed 6-bit scales/mins in Q4_K and Q5_K

# Block layouts, field for field as in ggml-common.h.  "<f2" is ggml_half; all little-endian.
BLOCK_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
BLOCK_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
BLOCK_Q5_0 = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
BLOCK_Q5_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
BLOCK_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
BLOCK_Q2_K = np.dtype([("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")])
BLOCK_Q3_K = np.dtype([("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")])
BLOCK_Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", K_SCALE_SIZE), ("qs", "u1", 128)])
BLOCK_Q5_K = np.dtype(
    [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", K_SCALE_SIZE), ("qh", "u1", 32), ("qs", "u1", 128)]
)
BLOCK_Q6_K = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])
BLOCK_MXFP4 = np.dtype([("e", "u1"), ("qs", "u1", 16)])  # e: E8M0 exponent; qs: E2M1 nibbles (q4_0 order)

# The 16 E2M1 codes as integers twice their value (ggml's kvalues_mxfp4): code 8 is -0.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

# Shift amounts, shaped to broadcast over a trailing (k, 32) or (k, 1) axis pair.
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(8, 1)
_BIT_SHIFTS_32 = np.arange(32, dtype=np.uint32)


def _half(x: np.ndarray) -> np.ndarray:
    """fp16 field -> float32 with a trailing axis, ready to broadcast over the block's elements."""
    return x.astype(np.float32)[..., None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32): low nibbles are elements 0..15, high nibbles 16..31 (q4_0/q5_0 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """(...,) uint32 -> (..., 32) uint8: bit j of qh is the fifth bit of element j."""
    return ((qh[..., None] >> _BIT_SHIFTS_32) & 1).astype(np.uint8)


def dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks["qs"]).astype(np.int8) - np.int8(8)
    return _half(blocks["d"]) * q.astype(np.float32)


def dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks["qs"]).astype(np.float32)
    return _half(blocks["d"]) * q + _half(blocks["m"])


def dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks["qs"]) | (_high_bits_32(blocks["qh"]) << 4)
    return _half(blocks["d"]) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks["qs"]) | (_high_bits_32(blocks["qh"]) << 4)
    return _half(blocks["d"]) * q.astype(np.float32) + _half(blocks["m"])


def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks["d"]) * blocks["qs"].astype(np.float32)


def _per_16(scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Apply one scale per 16 elements: scale (..., 16) times q (..., 256) viewed as (..., 16, 16)."""
    lead = q.shape[:-1]
    return (scale[..., None] * q.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


def dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    # Each 128-element half uses 32 bytes of qs; the four 2-bit crumbs of a byte go to four 32-runs.
    qs = blocks["qs"].reshape(*blocks.shape, 2, 1, 32)
    q = ((qs >> _CRUMB_SHIFTS) & 3).astype(np.float32).reshape(*blocks.shape, 16, 16)
    sc = blocks["scales"]
    dl = _half(blocks["d"]) * (sc & 0x0F).astype(np.float32)  # low nibble: scale
    ml = _half(blocks["dmin"]) * (sc >> 4).astype(np.float32)  # high nibble: min
    return (dl[..., None] * q - ml[..., None]).reshape(*blocks.shape, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0..7 (low then high nibbles),
    high 2 bits from bytes 8..11, crumb i // 4 of byte 8 + i % 4."""
    low = np.concatenate([packed[..., :8] & 0x0F, packed[..., :8] >> 4], axis=-1)
    high = (packed[..., None, 8:] >> _CRUMB_SHIFTS) & 3  # (..., 4 crumbs, 4 bytes)
    sc = low | (high.reshape(*packed.shape[:-1], 16) << 4)
    return sc.astype(np.int8) - np.int8(32)


def _k_high_bits(h: np.ndarray) -> np.ndarray:
    """(..., 32) bytes -> (..., 8, 32): bit k of byte l belongs to element 32*k + l."""
    return (h[..., None, :] >> _BIT_SHIFTS) & 1


def dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    qs = blocks["qs"].reshape(*blocks.shape, 2, 1, 32)
    low = ((qs >> _CRUMB_SHIFTS) & 3).reshape(*blocks.shape, 8, 32)
    # A *clear* hmask bit means "subtract 4" (the quant is low - 4); a set bit means no offset.
    q = low.astype(np.int8) - ((_k_high_bits(blocks["hmask"]) ^ 1) << 2).astype(np.int8)
    dl = _half(blocks["d"]) * _q3_k_scales(blocks["scales"]).astype(np.float32)
    return _per_16(dl, q.astype(np.float32).reshape(*blocks.shape, QK_K))


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).

    Sub-blocks 0..3 use the low 6 bits of bytes 0..3 (scale) and 4..7 (min); sub-blocks 4..7 take
    their low 4 bits from the nibbles of bytes 8..11 and their top 2 bits from the spare
    top bits of bytes 0..3 (scale) and 4..7 (min).
    """
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _k4_apply(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """y = (d * sc) * q - dmin * m, one (sc, m) pair per 32 elements; q is (..., 8, 32) float32."""
    sc, mn = _k4_scales_mins(blocks["scales"])
    d = (_half(blocks["d"]) * sc.astype(np.float32))[..., None]
    m = (_half(blocks["dmin"]) * mn.astype(np.float32))[..., None]
    return (d * q - m).reshape(*blocks.shape, QK_K)


def _k4_low(qs: np.ndarray) -> np.ndarray:
    """(..., 128) bytes -> (..., 8, 32): each 64-element chunk is 32 low nibbles then 32 high nibbles."""
    lead = qs.shape[:-1]
    return ((qs.reshape(*lead, 4, 1, 32) >> _NIBBLE_SHIFTS) & 0x0F).reshape(*lead, 8, 32)


def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    return _k4_apply(blocks, _k4_low(blocks["qs"]).astype(np.float32))


def dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    q = _k4_low(blocks["qs"]) | (_k_high_bits(blocks["qh"]) << 4)
    return _k4_apply(blocks, q.astype(np.float32))


def dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    lead = blocks.shape
    # Per 128-element half: 64 ql bytes (low nibbles feed runs 0,1; high nibbles runs 2,3)
    # and 32 qh bytes whose four crumbs are the top 2 bits of runs 0..3.
    ql = blocks["ql"].reshape(*lead, 2, 1, 2, 32) >> _NIBBLE_SHIFTS[..., None]
    low = (ql & 0x0F).reshape(*lead, 2, 4, 32)
    high = (blocks["qh"].reshape(*lead, 2, 1, 32) >> _CRUMB_SHIFTS) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    dl = _half(blocks["d"]) * blocks["scales"].astype(np.float32)
    return _per_16(dl, q.astype(np.float32).reshape(*lead, QK_K))


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> float32 2**(e - 128): the block scale halved, since MXFP4_VALUES are
    doubled.  Built from the bits (e < 2 are subnormal), as ggml_e8m0_to_fp32_half."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequant_mxfp4(blocks: np.ndarray) -> np.ndarray:
    q = MXFP4_VALUES[_nibbles(blocks["qs"])]
    return e8m0_half(blocks["e"])[..., None] * q.astype(np.float32)


Dequantizer = Callable[[np.ndarray], np.ndarray]

_LAYOUTS: dict[str, tuple[np.dtype, Dequantizer]] = {
    "Q4_0": (BLOCK_Q4_0, dequant_q4_0),
    "Q4_1": (BLOCK_Q4_1, dequant_q4_1),
    "Q5_0": (BLOCK_Q5_0, dequant_q5_0),
    "Q5_1": (BLOCK_Q5_1, dequant_q5_1),
    "Q8_0": (BLOCK_Q8_0, dequant_q8_0),
    "Q2_K": (BLOCK_Q2_K, dequant_q2_k),
    "Q3_K": (BLOCK_Q3_K, dequant_q3_k),
    "Q4_K": (BLOCK_Q4_K, dequant_q4_k),
    "Q5_K": (BLOCK_Q5_K, dequant_q5_k),
    "Q6_K": (BLOCK_Q6_K, dequant_q6_k),
    "MXFP4": (BLOCK_MXFP4, dequant_mxfp4),
}

# Type name -> (block layout, elements per block, dequantizer).  Elements per block come from the
# type table (types.py); each layout's itemsize is the table's type size (tests check both).
BLOCK_KERNELS: dict[str, tuple[np.dtype, int, Dequantizer]] = {
    name: (layout, QUANT_BY_NAME[name].block_size, kernel) for name, (layout, kernel) in _LAYOUTS.items()
}


def dequant_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift the 16 bits up and reinterpret."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
