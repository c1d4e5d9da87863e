"""GGML tensor types: sizes (the table in types.py), names, and NumPy dequantization to float32.

``dequantize(data, ggml_type)`` takes a tensor exactly as ``gguf.GGUFReader`` exposes it (raw block
bytes for quantized types, float arrays for F32/F16) and returns float32 with the logical row length.
Results are bit-for-bit identical to ``gguf.quants.dequantize`` (and to ggml's reference code).
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelFormatError
from .ggml import BLOCK_KERNELS, dequant_bf16
from .types import QUANT_BY_NAME, QUANT_TYPES, QuantType

__all__ = [
    "QUANT_BY_NAME",
    "QUANT_TYPES",
    "QuantType",
    "dequantize",
    "is_supported",
    "row_bytes",
    "type_name",
    "unsupported_message",
]


# Rows are dequantized in chunks of about this many output elements, so temporaries stay
# cache-sized instead of being several times the size of a whole (possibly huge) tensor.
_CHUNK_ELEMENTS = 1 << 18


def is_supported(ggml_type: int) -> bool:
    return int(ggml_type) in QUANT_TYPES


def type_name(ggml_type: int) -> str:
    """ "Q4_K" for a known GGML type (including ones we cannot dequantize), else "type 99"."""
    qt = QUANT_TYPES.get(int(ggml_type))
    if qt is not None:
        return qt.name
    from gguf import GGMLQuantizationType  # lazy: only needed to name types we do not support

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def unsupported_message(ggml_type: int) -> str:
    supported = ", ".join(qt.name for qt in QUANT_TYPES.values())
    return f"tensor type {type_name(ggml_type)} is not supported (supported: {supported})"


def _lookup(ggml_type: int) -> QuantType:
    qt = QUANT_TYPES.get(int(ggml_type))
    if qt is None:
        raise ModelFormatError(unsupported_message(ggml_type))
    return qt


def row_bytes(ggml_type: int, n_per_row: int) -> int:
    """Bytes in one row of ``n_per_row`` elements; the row must be a whole number of blocks."""
    return _lookup(ggml_type).row_bytes(n_per_row)


def _reinterpret(data: np.ndarray, dtype: np.dtype | str) -> np.ndarray:
    """View ``data`` as ``dtype`` (same bytes); copies only if the last axis is not contiguous."""
    if data.dtype == dtype:
        return data
    if data.ndim and data.strides[-1] != data.itemsize:
        data = np.ascontiguousarray(data)
    return data.view(dtype)


def dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray:
    """Raw tensor data of shape (..., row_bytes) -> float32 of shape (..., n_per_row).

    F32 data that is already float32 is returned as is (it may be a read-only memmap view);
    every other type produces a new array.
    """
    qt = _lookup(ggml_type)
    if qt.name == "F32":
        return _reinterpret(data, np.dtype("<f4"))
    if qt.name == "F16":
        return _reinterpret(data, np.dtype("<f2")).astype(np.float32)
    if qt.name == "BF16":
        # GGUFReader hands BF16 over as raw bytes (uint8, two per element); accept 16-bit ints too.
        return dequant_bf16(_reinterpret(data, np.dtype("<u2")))
    return _dequantize_blocks(_reinterpret(data, np.dtype(np.uint8)), qt)


def _dequantize_blocks(data: np.ndarray, qt: QuantType) -> np.ndarray:
    layout, block_size, kernel = BLOCK_KERNELS[qt.name]
    n_bytes = data.shape[-1] if data.ndim else 0
    if data.ndim == 0 or n_bytes % qt.type_size:
        raise ValueError(f"{qt.name}: row of {n_bytes} bytes is not a multiple of {qt.type_size}")
    n_per_row = n_bytes // qt.type_size * block_size
    rows = data.reshape(-1, n_bytes)  # a view for whole tensors and contiguous row slices
    out = np.empty((rows.shape[0], n_per_row), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // max(n_per_row, 1))
    for start in range(0, rows.shape[0], step):
        # Only this chunk is made contiguous (a no-op for memmap rows), then viewed as structs.
        blocks = np.ascontiguousarray(rows[start : start + step]).view(layout)
        out[start : start + step] = kernel(blocks).reshape(blocks.shape[0], n_per_row)
    return out.reshape(*data.shape[:-1], n_per_row)
