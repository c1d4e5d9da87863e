"""The on-disk cache of parsed GGUF headers.

Parsing a large vocabulary still costs a fraction of a second, so the index (metadata + tensor table)
is cached, keyed by the file's path, size and mtime. A cached index is trusted only if a hash of the
file's header bytes still matches and it passes the same validation, so a tampered file is re-read.
Unpickling resolves only the few classes an index holds, so a planted cache file cannot name a
callable (os.system and the like) to run at load.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
from pathlib import Path
from typing import Any

from localllm.loading.checks import validate_index
from localllm.loading.index import GGUFIndex
from localllm.loading.parser import digest, read_index

INDEX_VERSION = 6  # 6: the index classes moved to localllm.loading.index

# (module, name) of every global a pickled GGUFIndex refers to; numpy 1.x names its core `numpy.core`
_ALLOWED = {
    ("localllm.loading.index", "GGUFIndex"),
    ("localllm.loading.index", "TensorInfo"),
    ("localllm.text_table", "TextTable"),
    ("numpy", "dtype"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.numeric", "_frombuffer"),
    ("array", "array"),
    ("array", "_array_reconstructor"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a cached index")
        return super().find_class(module, name)


def _index_path(path: Path, index_dir: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{INDEX_VERSION}"
    return index_dir / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pkl")


def index_cache_path(path: str | os.PathLike, index_dir: Path) -> Path:
    """The file in index_dir that caches the parsed index of the GGUF file `path` (for `rm`; each
    shard of a split model has its own)."""
    return _index_path(Path(path), index_dir)


def load_index(path: Path, index_dir: Path | None) -> GGUFIndex:
    cached = _index_path(path, index_dir) if index_dir is not None else None
    if cached is not None and cached.exists():
        index = _read_cached(cached, path)
        if index is not None:
            return index
    index = read_index(path)
    if cached is not None:
        _write_atomic(cached, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    return index


def _read_cached(cached: Path, path: Path) -> GGUFIndex | None:
    """The cached index if it still describes the file and passes validation; else None (re-read)."""
    try:
        with open(cached, "rb") as f:
            index = _IndexUnpickler(f).load()
        if not isinstance(index, GGUFIndex):
            return None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if digest(mm, index.data_offset) != index.header_digest:
                return None
            validate_index(index, len(mm))
        return index
    except Exception:  # a stale, damaged or tampered cache is rebuilt, never trusted
        return None


def _write_atomic(dest: Path, data: bytes) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    except OSError:  # a read-only cache only costs speed
        pass
