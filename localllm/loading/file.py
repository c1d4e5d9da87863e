"""A GGUF model, memory-mapped: metadata and tensors kept in their quantized form.

`GGUFFile.open` checks the magic, reads the header through the index cache (`cache`, `parser`),
opens the rest of a split set (`splits`) and maps every file; `raw` then hands out tensors as views.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.loading.cache import load_index
from localllm.loading.index import GGUFIndex, TensorInfo
from localllm.loading.parser import GGML_F16, GGML_F32, check_header
from localllm.loading.splits import check_split, merged_tensors, open_shard, split_paths


@dataclass(frozen=True, slots=True)
class Shard:
    """One file of a model: where its tensor data starts and how big it is."""

    path: Path
    data_offset: int
    alignment: int
    size: int


class GGUFFile:
    """A GGUF model, one file or a split set: `metadata` (key -> python value) and `tensors` (name ->
    TensorInfo, its `shard` saying which file holds it). `path` is the first (or only) file."""

    def __init__(self, paths: list[Path], indexes: list[GGUFIndex]):
        self.paths = paths
        self.path = paths[0]
        self.metadata = indexes[0].metadata  # gguf-split keeps all metadata in the first shard
        self.tensors = merged_tensors(indexes)
        self._mms = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths]
        self.shards = [
            Shard(p, ix.data_offset, ix.alignment, int(mm.shape[0]))
            for p, ix, mm in zip(paths, indexes, self._mms, strict=True)
        ]
        self.data_offset, self.alignment = indexes[0].data_offset, indexes[0].alignment
        self.header_digests = [ix.header_digest for ix in indexes]  # one per file (the KV fingerprint)

    @classmethod
    def open(cls, path: str | os.PathLike, index_dir: Path | None = None) -> GGUFFile:
        """The model in `path`; for a split model, any of its files opens all of them."""
        path = Path(path)
        check_header(path)
        index = load_index(path, index_dir)
        paths = split_paths(path, index.metadata)
        if len(paths) == 1:
            return cls(paths, [index])
        indexes = [index if p == path else open_shard(p, paths, index_dir) for p in paths]
        check_split(paths, indexes)
        return cls(paths, indexes)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def size(self) -> int:
        """Bytes in all the model's files."""
        return sum(s.size for s in self.shards)

    def identity(self) -> str:
        """What a cache derived from this model keys on: each file's path, size and mtime."""
        parts = []
        for p in self.paths:
            st = p.stat()
            parts.append(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}")
        return "|".join(parts)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key such as `attention.head_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: float arrays for F32/F16, uint8 (rows, row_bytes) for quants."""
        info = self.tensors[name]
        buf = self._mms[info.shard][info.offset : info.offset + info.nbytes]
        return _view(buf, info)

    def release_pages(self) -> None:
        """Let go of the file pages this process has mapped so far; they stay in the page cache, and a
        tensor read again maps its pages back. After a load that copied what it needs (packed
        matrices, float vectors), the file's pages would otherwise stay in RSS beside the copies:
        the vectors lie between matrices, and each read maps its 64 KiB neighbourhood (Gemma 3: 5 MiB;
        a first run, which packs every matrix from the file, the whole file)."""
        for mm in self._mms:
            _drop_pages(mm, 0, mm.shape[0])

    def release(self, array: np.ndarray) -> None:
        """release_pages for the pages under one view from this file (a tensor just packed): a first
        run packs every matrix, and the file's pages would otherwise add up to the file's size in RSS
        beside the packed copies until the load ends."""
        for mm in self._mms:
            start = array.__array_interface__["data"][0] - mm.ctypes.data
            if 0 <= start < mm.shape[0]:
                _drop_pages(mm, start, min(start + array.nbytes, mm.shape[0]))

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where a contiguous view from `raw` starts, counting through the shards as if they were one
        file; None for any other array."""
        base = 0
        for mm in self._mms:
            start = array.__array_interface__["data"][0] - mm.ctypes.data
            if array.flags.c_contiguous and 0 <= start and start + array.nbytes <= mm.shape[0]:
                return int(base + start)
            base += int(mm.shape[0])
        return None


def _drop_pages(mm: np.memmap, start: int, end: int) -> None:
    """madvise(DONTNEED) the mapped pages of bytes start..end of mm (from start's page on)."""
    advice, raw = getattr(mmap, "MADV_DONTNEED", None), getattr(mm, "_mmap", None)  # np.memmap's mmap
    if advice is not None and raw is not None:
        first = start - start % mmap.PAGESIZE
        raw.madvise(advice, first, end - first)


def _view(buf: np.ndarray, info: TensorInfo) -> np.ndarray:
    if info.ggml_type == GGML_F32:
        return buf.view(np.float32).reshape(info.shape)
    if info.ggml_type == GGML_F16:
        return buf.view(np.float16).reshape(info.shape)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    view = buf.reshape(rows, info.nbytes // rows)
    return view.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else view[0]
