"""The one table of GGML tensor types: per type, its id, elements and bytes per block, and whether the
Numba backend has an integer (repacked) kernel for it.

Every other place that needs such a fact (the NumPy block layouts in ggml.py, the repacker in
kernels/packing.py, the row dequantizers in kernels/dequant.py) reads it from here; tests check the
table against `gguf.GGML_QUANT_SIZES`.  No numpy here, so the table is cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # elements per super-block of the k-quants


@dataclass(frozen=True, slots=True)
class QuantType:
    name: str
    ggml_type: int  # id as in gguf.GGMLQuantizationType
    block_size: int  # elements per block
    type_size: int  # bytes per block
    int_kernel: bool = False  # the Numba backend repacks it for its integer matmul kernels

    def row_bytes(self, n_per_row: int) -> int:
        """Bytes in one row of `n_per_row` elements; the row must be a whole number of blocks."""
        if n_per_row % self.block_size:
            raise ValueError(
                f"{self.name} rows must be a multiple of {self.block_size} elements, got {n_per_row}"
            )
        return n_per_row // self.block_size * self.type_size


QUANT_TYPES: dict[int, QuantType] = {
    qt.ggml_type: qt
    for qt in (
        QuantType("F32", 0, 1, 4),
        QuantType("F16", 1, 1, 2),
        QuantType("Q4_0", 2, 32, 18, int_kernel=True),
        QuantType("Q4_1", 3, 32, 20, int_kernel=True),
        QuantType("Q5_0", 6, 32, 22, int_kernel=True),
        QuantType("Q5_1", 7, 32, 24, int_kernel=True),
        QuantType("Q8_0", 8, 32, 34, int_kernel=True),
        QuantType("Q2_K", 10, QK_K, 84),
        QuantType("Q3_K", 11, QK_K, 110),
        QuantType("Q4_K", 12, QK_K, 144, int_kernel=True),
        QuantType("Q5_K", 13, QK_K, 176, int_kernel=True),
        QuantType("Q6_K", 14, QK_K, 210, int_kernel=True),
        QuantType("BF16", 30, 1, 2),
        # 32 E2M1 (4-bit float) values sharing one E8M0 (power-of-two) scale; gpt-oss's experts
        QuantType("MXFP4", 39, 32, 17, int_kernel=True),
    )
}

QUANT_BY_NAME: dict[str, QuantType] = {qt.name: qt for qt in QUANT_TYPES.values()}
