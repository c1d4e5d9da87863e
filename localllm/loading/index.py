"""What a GGUF header says, as records: each tensor's `TensorInfo` and the file's `GGUFIndex`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: (rows, n_per_row) for matrices
    offset: int  # absolute byte offset in the file (its shard's, for a split model)
    nbytes: int
    shard: int = 0  # which file of a split model holds it (0: the first, or the only one)

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """What the header says, plus what it takes to trust a cached copy of it."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int  # where the tensor data section starts
    alignment: int
    header_digest: str  # sha256 of the bytes before data_offset
