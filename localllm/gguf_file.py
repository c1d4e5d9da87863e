"""GGUF files, memory-mapped: metadata and tensors kept in their quantized form.

The first open goes through the `gguf` package's reader. Its parse of a large vocabulary costs seconds
(one numpy view per string), so the parsed index (metadata + tensor offsets) is cached, keyed by the
file's path, size and mtime; later opens read the index and memory-map the file directly.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import ModelFormatError

INDEX_VERSION = 1
GGML_F32, GGML_F16 = 0, 1  # GGMLQuantizationType values, without importing gguf (~30 ms) to name them


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: (rows, n_per_row) for matrices
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]


class GGUFFile:
    """A GGUF model file: `metadata` (key -> python value) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo]):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")

    @classmethod
    def open(cls, path: str | os.PathLike, index_dir: Path | None = None) -> GGUFFile:
        path = Path(path)
        _check_header(path)
        metadata, tensors = _load_index(path, index_dir)
        return cls(path, metadata, tensors)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def size(self) -> int:
        return int(self._mm.shape[0])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key such as `attention.head_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: float arrays for F32/F16, uint8 (rows, row_bytes) for quants."""
        info = self.tensors[name]
        buf = self._mm[info.offset : info.offset + info.nbytes]
        return _view(buf, info)

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where in the file a contiguous view from `raw` starts; None for any other array."""
        start = array.__array_interface__["data"][0] - self._mm.ctypes.data
        if array.flags.c_contiguous and 0 <= start and start + array.nbytes <= self.size:
            return int(start)
        return None


def _view(buf: np.ndarray, info: TensorInfo) -> np.ndarray:
    if info.ggml_type == GGML_F32:
        return buf.view(np.float32).reshape(info.shape)
    if info.ggml_type == GGML_F16:
        return buf.view(np.float16).reshape(info.shape)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    view = buf.reshape(rows, info.nbytes // rows)
    return view.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else view[0]


def _check_header(path: Path) -> None:
    if not path.exists():
        raise ModelFormatError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic)")


def _index_path(path: Path, index_dir: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{INDEX_VERSION}"
    return index_dir / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pkl")


def _load_index(path: Path, index_dir: Path | None) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    cached = _index_path(path, index_dir) if index_dir is not None else None
    if cached is not None and cached.exists():
        try:
            with open(cached, "rb") as f:
                return pickle.load(f)
        except Exception:  # a stale or damaged cache is rebuilt, never trusted
            pass
    index = _read_with_gguf(path)
    if cached is not None:
        _write_atomic(cached, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    return index


def _write_atomic(dest: Path, data: bytes) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    except OSError:  # a read-only cache only costs speed
        pass


def _read_with_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises many kinds of errors on damaged files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFormatError(
            f"cannot read {path.name}: the GGUF file is truncated or corrupt ({reason})"
        ) from None
    metadata = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        info = TensorInfo(
            name=t.name,
            ggml_type=int(t.tensor_type),
            shape=tuple(int(x) for x in reversed(t.shape.tolist())),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
        if info.offset + info.nbytes > size:
            raise ModelFormatError(
                f"{path.name} is truncated: tensor '{t.name}' ends at byte {info.offset + info.nbytes:,} "
                f"but the file has {size:,} bytes"
            )
        tensors[t.name] = info
    return metadata, tensors


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, list) and value and isinstance(value[0], (int, float)) and len(value) > 64:
        return np.asarray(value)  # token types / scores: compact and fast to pickle
    return value
