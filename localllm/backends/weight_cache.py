"""A disk cache of repacked weights, so a model is repacked once, not at every start.

Repacking every matrix of a model into the kernels' lane layout (kernels/packing.py) costs about a
second for a 135M model.  The first load writes all packed buffers to one file, keyed like the GGUF
index cache (path, size, mtime, of every file of a split model) plus a hash of packing.py, whose layout
the bytes follow; later loads memory-map that file, so the weights cost page-cache memory only, as the
GGUF file itself does.

File: MAGIC, u64 index length, u32 CRC of the index, the JSON index, then each buffer page-aligned.
It is written front to back in whole 4 MiB chunks and mapped with MADV_HUGEPAGE: on Linux the page
cache then holds it in 2 MiB folios (also when it is read back after eviction), which map with 2 MiB
pages, so a decode step's weight stream takes far fewer TLB misses than through 4 KiB pages.
Anything unexpected (another key, a bad CRC, a short file) makes the cache count as absent: the
weights are repacked and the file rewritten.  Writes go to a temporary file renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from localllm.kernels import packing
from localllm.kernels.packing import PackedWeight, pack_weight

FORMAT_VERSION = 2  # 2: entries name the rows gathered from a tensor ("" for all of it)
MAGIC = b"LLMPACK1"
_HEADER = struct.Struct("<8sQI")  # magic, index length, index CRC32
_ALIGN = 4096  # page-aligned buffers: at least the alignment the kernels get from np.empty
_CHUNK = 4 << 20  # the write size: whole, aligned multiples of a huge page

Entry = tuple[int, int, tuple[int, ...], str]  # (file offset, GGML type, shape, rows digest): one matrix


def packing_digest() -> str:
    """A hash of packing.py: any change to it may change the layout of the cached bytes."""
    return hashlib.sha256(Path(packing.__file__).read_bytes()).hexdigest()[:16]


def cache_files(model: str | os.PathLike, cache_dir: Path) -> list[Path]:
    """The packed-weight cache files of the GGUF file `model` in cache_dir (e.g. for `rm` to delete)."""
    return sorted(cache_dir.glob(f"{_model_prefix(Path(model))}-*.wpack"))


def _model_prefix(model: Path) -> str:
    # One file per model path: a newer key replaces the older file instead of piling up.
    return hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:16]


class WeightCache:
    """Packs the matrices of one GGUF file, reusing the buffers a previous load wrote to disk."""

    def __init__(self, gf: Any, cache_dir: Path):
        self.gf = gf
        path = Path(gf.path).resolve()
        # every file of a split model: a change to any of them changes the key (offsets count through them)
        self.key = f"{gf.identity()}|{FORMAT_VERSION}|{packing_digest()}"
        self._prefix = _model_prefix(path)
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        self.path = cache_dir / f"{self._prefix}-{digest}.wpack"
        self._cached = _read(self.path, self.key)
        self._packed: dict[Entry, PackedWeight] = {}
        self.misses = 0

    def pack(self, raw: np.ndarray, ggml_type: int) -> PackedWeight:
        """pack_weight(raw, ggml_type), from the cache file when it holds this tensor."""
        return self._lookup(raw, None, ggml_type)

    def pack_rows(self, raw: np.ndarray, rows: np.ndarray, ggml_type: int) -> PackedWeight:
        """pack_weight(raw[rows], ggml_type): the rows are gathered (reading those pages of the file)
        only when the cache file does not hold them packed."""
        return self._lookup(raw, rows, ggml_type)

    def _lookup(self, raw: np.ndarray, rows: np.ndarray | None, ggml_type: int) -> PackedWeight:
        offset = self.gf.offset_of(raw)
        shape = tuple(raw.shape) if rows is None else (len(rows), *raw.shape[1:])
        tag = "" if rows is None else hashlib.sha256(np.asarray(rows, np.int64).tobytes()).hexdigest()[:16]
        entry = (offset, int(ggml_type), shape, tag) if offset is not None else None
        w = self._cached.get(entry) if entry is not None else None
        if w is None or w.n != shape[0]:
            w = pack_weight(raw if rows is None else np.ascontiguousarray(raw[rows]), ggml_type)
            self.misses += w.lane  # row kinds are views of the file: nothing to cache or save
            if w.lane and rows is None:
                self.gf.release(raw)  # packed: its file pages are not needed again
        if entry is not None and w.lane:
            self._packed[entry] = w
        return w

    def save(self) -> None:
        """Write the cache file if this load packed anything the file did not already hold."""
        if not (self.misses and self._packed):
            return
        _write(self.path, self.key, self._packed, Path(self.gf.path).resolve())
        with contextlib.suppress(OSError):
            for old in self.path.parent.glob(f"{self._prefix}-*.wpack"):
                if old != self.path:
                    old.unlink()
        prune_orphans(self.path.parent)


def prune_orphans(cache_dir: Path) -> list[Path]:
    """Delete the cache files whose model file is gone (deleted or moved outside `rm`): a packed copy
    is as large as the model, and nothing else would ever remove it.  Returns the files deleted."""
    gone = []
    for path in cache_dir.glob("*.wpack"):
        model = _model_of(path)
        if model is not None and not Path(model).exists():
            with contextlib.suppress(OSError):
                path.unlink()
                gone.append(path)
    return gone


def _model_of(path: Path) -> str | None:
    """The model path a cache file records (None: unreadable, or written before files recorded it)."""
    try:
        with open(path, "rb") as f:
            magic, length, crc = _HEADER.unpack(f.read(_HEADER.size))
            text = f.read(length) if magic == MAGIC and length <= os.fstat(f.fileno()).st_size else b""
        model = json.loads(text).get("model") if text and zlib.crc32(text) == crc else None
        return model if isinstance(model, str) else None
    except (OSError, ValueError, struct.error, AttributeError):
        return None


def _read(path: Path, key: str) -> dict[Entry, PackedWeight]:
    """The cached weights, or {} when the file is missing, stale or damaged."""
    try:
        with open(path, "rb") as f:
            magic, length, crc = _HEADER.unpack(f.read(_HEADER.size))
            if magic != MAGIC or length > os.fstat(f.fileno()).st_size:
                return {}
            text = f.read(length)
        if len(text) != length or zlib.crc32(text) != crc:
            return {}
        index = json.loads(text)
        if index["key"] != key:
            return {}
        return _map(path, _aligned(_HEADER.size + length), index["weights"])
    except Exception:  # a damaged cache is rebuilt, never trusted (as the GGUF index cache)
        return {}


def _map(path: Path, base: int, rows: list[list[Any]]) -> dict[Entry, PackedWeight]:
    """Memory-map the buffers (read-only: the kernels never write to weights)."""
    size = path.stat().st_size
    if any(start < 0 or nbytes <= 0 or base + start + nbytes > size for *_, start, nbytes in rows):
        return {}  # a short file: truncated since it was written
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    raw = getattr(mm, "_mmap", None)  # np.memmap's mmap
    if raw is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            raw.madvise(mmap.MADV_HUGEPAGE)  # a fault reads (and maps) a whole huge folio
    out = {}
    for offset, ggml_type, shape, tag, kind, n, k, start, nbytes in rows:
        buf = mm[base + start : base + start + nbytes]
        out[(offset, ggml_type, tuple(shape), str(tag))] = PackedWeight(kind, ggml_type, n, k, buf)
    return out


def _write(path: Path, key: str, weights: dict[Entry, PackedWeight], model: Path) -> None:
    """Header and index, then the buffers from the next page boundary ("start" counts from there)."""
    rows, pos = [], 0
    for (offset, ggml_type, shape, tag), w in weights.items():
        rows.append([offset, ggml_type, list(shape), tag, w.kind, w.n, w.k, pos, w.nbytes])
        pos = _aligned(pos + w.nbytes)
    text = json.dumps({"key": key, "model": str(model), "weights": rows}).encode()
    base = _aligned(_HEADER.size + len(text))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # (a BufferedWriter completes short writes)
            out = _ChunkWriter(f)
            out.put(0, _HEADER.pack(MAGIC, len(text), zlib.crc32(text)) + text)
            for row, w in zip(rows, weights.values(), strict=True):
                out.put(base + row[7], np.ascontiguousarray(w.buf).data)
            out.close()
        os.replace(tmp, path)
    except OSError:  # a full disk or a read-only cache only costs speed
        with contextlib.suppress(OSError):
            tmp.unlink()


class _ChunkWriter:
    """Writes a file front to back in whole _CHUNK-sized writes at multiples of _CHUNK (the last one
    short): a write's size and alignment decide the size of the page-cache folios it fills."""

    def __init__(self, f: Any):
        self.f, self.buf, self.fill = f, bytearray(_CHUNK), 0
        self.start = 0  # the file offset of buf[0]

    def put(self, offset: int, data: Any) -> None:
        """data at `offset`, at or past the end of everything put before (a gap reads as zeros)."""
        gap = offset - self.start - self.fill
        if gap < 0:
            raise ValueError("pieces must come in file order")
        while gap:
            n = min(gap, _CHUNK - self.fill)
            self._take(bytes(n))
            gap -= n
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = min(view.nbytes, _CHUNK - self.fill)
            self._take(view[:n])
            view = view[n:]

    def _take(self, piece: Any) -> None:
        n = len(piece)
        self.buf[self.fill : self.fill + n] = piece
        self.fill += n
        if self.fill == _CHUNK:
            self._flush()

    def _flush(self) -> None:
        self.f.write(memoryview(self.buf)[: self.fill])
        self.start, self.fill = self.start + self.fill, 0

    def close(self) -> None:
        if self.fill:
            self._flush()


def _aligned(pos: int) -> int:
    return -(-pos // _ALIGN) * _ALIGN
