"""GGUF files, memory-mapped: metadata and tensors kept in their quantized form.

The header (metadata and tensor table) is read by a small parser of our own that checks every count
and string length against the bytes left in the file before it allocates anything, so a damaged or
hostile file ends in one `ModelFormatError` rather than a hang or a huge allocation; the result is then
validated (`localllm.gguf_check`) before any tensor is handed out. The `gguf` package stays the
reference for the format and is what the tests write files with.

Parsing a large vocabulary still costs a fraction of a second, so the index (metadata + tensor table)
is cached, keyed by the file's path, size and mtime. A cached index is trusted only if a hash of the
file's header bytes still matches and it passes the same validation, so a tampered file is re-read.

A model split by llama.cpp's gguf-split (`NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`:
`split.no`, `split.count` and `split.tensors.count` in each, all other metadata in the first) opens as
one `GGUFFile` from any of its files: each shard is parsed, cached and validated as a file of its own,
then the set is checked (every shard present, numbered as named, the tensor count the first promises,
no tensor twice) and its tensors merged, each remembering its shard.
"""

from __future__ import annotations

import codecs
import hashlib
import mmap
import os
import pickle
import re
import struct
from array import array
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.text_table import TextTable

INDEX_VERSION = 5
GGML_F32, GGML_F16 = 0, 1  # GGMLQuantizationType values, without importing gguf (~30 ms) to name them
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16
GGUF_STRING, GGUF_ARRAY = 8, 9
# GGUFValueType -> struct format of a scalar (also a numpy dtype string for arrays of it)
SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
TEXT_TABLE_MIN = 1024  # string arrays this long (vocabularies, merges) are read as one TextTable
SMALL_ARRAY = 64  # numeric arrays up to this length become lists, longer ones stay numpy arrays
MAX_KEY_BYTES = 1024  # keys are short dotted names
MAX_NAME_BYTES = 256  # ggml's own limit (GGML_MAX_NAME) is 64
DECODE_CHUNK = 1 << 14
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
# llama.cpp's split file names (llama_split_path: "%s-%05d-of-%05d.gguf", shards numbered from 1)
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf", re.I)
MAX_SHARDS = 0xFFFF  # split.count is a u16


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
        self.tensors = _merged_tensors(indexes)
        self._mms = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths]
        self.shards = [
            Shard(p, ix.data_offset, ix.alignment, int(mm.shape[0]))
            for p, ix, mm in zip(paths, indexes, self._mms, strict=True)
        ]
        self.data_offset, self.alignment = indexes[0].data_offset, indexes[0].alignment

    @classmethod
    def open(cls, path: str | os.PathLike, index_dir: Path | None = None) -> GGUFFile:
        """The model in `path`; for a split model, any of its files opens all of them."""
        path = Path(path)
        _check_header(path)
        index = _load_index(path, index_dir)
        paths = split_paths(path, index.metadata)
        if len(paths) == 1:
            return cls(paths, [index])
        indexes = [index if p == path else _open_shard(p, paths, index_dir) for p in paths]
        _check_split(paths, indexes)
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
        advice = getattr(mmap, "MADV_DONTNEED", None)
        for mm in self._mms:
            raw = getattr(mm, "_mmap", None)  # np.memmap's mmap.mmap
            if advice is not None and raw is not None:
                raw.madvise(advice)

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


# ---------------------------------------------------------------- split models


def split_paths(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """All files of the model `path` belongs to: [path] unless its metadata says it is a shard of a
    split model, whose files are then named as llama.cpp's gguf-split names them."""
    count = metadata.get("split.count", 0)
    if not _is_count(count) or count > MAX_SHARDS:
        raise ModelFormatError(f"{path.name}: 'split.count' is {count!r}; expected 0 to {MAX_SHARDS:,}")
    if count <= 1:
        return [path]
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or int(match["count"]) != count:
        raise ModelFormatError(
            f"{path.name} is one of {count} files of a split model, but its name does not end in "
            f"-NNNNN-of-{count:05d}.gguf, so the other files cannot be found (keep gguf-split's names)"
        )
    return _shard_paths(path, match)


def split_names(path: str | os.PathLike) -> list[Path]:
    """The files of the split model `path` names by its file name alone (for `rm` and `list`);
    [path] when the name is not a shard's."""
    path = Path(path)
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or not 1 < int(match["count"]) <= MAX_SHARDS:
        return [path]
    return _shard_paths(path, match)


def _shard_paths(path: Path, match: re.Match[str]) -> list[Path]:
    prefix, count = match["prefix"], match["count"]
    return [path.with_name(f"{prefix}-{i:05d}-of-{count}.gguf") for i in range(1, int(count) + 1)]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _open_shard(path: Path, paths: list[Path], index_dir: Path | None) -> GGUFIndex:
    if not path.is_file():
        raise ModelFormatError(
            f"{path.name} is missing: the split model {paths[0].name} needs all {len(paths)} of its files"
        )
    _check_header(path)
    return _load_index(path, index_dir)


def _check_split(paths: list[Path], indexes: list[GGUFIndex]) -> None:
    """Every shard is numbered as its name says, and together they hold the tensors the first promises."""
    for i, (path, index) in enumerate(zip(paths, indexes, strict=True)):
        no, count = index.metadata.get("split.no"), index.metadata.get("split.count")
        if no != i or count != len(paths):
            said = f"shard {no + 1} of {count}" if _is_count(no) and _is_count(count) else "no shard number"
            raise ModelFormatError(
                f"{path.name} holds {said} (split.no / split.count), not shard {i + 1} of {len(paths)} "
                "as its name says: the files are from different splits"
            )
    promised = indexes[0].metadata.get("split.tensors.count")
    held = sum(len(index.tensors) for index in indexes)
    if promised is not None and promised != held:
        raise ModelFormatError(
            f"{paths[0].name}: the split model promises {promised!r} tensors (split.tensors.count) but "
            f"its {len(paths)} files hold {held}"
        )
    seen: dict[str, int] = {}
    for i, index in enumerate(indexes):
        for name in index.tensors:
            if name in seen:
                where = f"{paths[seen[name]].name} and {paths[i].name}"
                raise ModelFormatError(f"tensor '{name}' is in both {where}")
            seen[name] = i


def _merged_tensors(indexes: list[GGUFIndex]) -> dict[str, TensorInfo]:
    if len(indexes) == 1:
        return indexes[0].tensors
    return {
        name: replace(info, shard=i)
        for i, index in enumerate(indexes)
        for name, info in index.tensors.items()
    }


# ---------------------------------------------------------------- the cached index


def _index_path(path: Path, index_dir: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{INDEX_VERSION}"
    return index_dir / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pkl")


def index_cache_path(path: str | os.PathLike, index_dir: Path) -> Path:
    """The file in index_dir that caches the parsed index of the GGUF file `path` (for `rm`; each
    shard of a split model has its own)."""
    return _index_path(Path(path), index_dir)


def _load_index(path: Path, index_dir: Path | None) -> GGUFIndex:
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
            index = pickle.load(f)
        if not isinstance(index, GGUFIndex):
            return None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if _digest(mm, index.data_offset) != index.header_digest:
                return None
            _validate(index, len(mm))
        return index
    except Exception:  # a stale, damaged or tampered cache is rebuilt, never trusted
        return None


def _digest(buf: Any, end: int) -> str:
    return hashlib.sha256(memoryview(buf)[:end]).hexdigest()


def _write_atomic(dest: Path, data: bytes) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    except OSError:  # a read-only cache only costs speed
        pass


def _validate(index: GGUFIndex, file_size: int) -> None:
    from localllm.gguf_check import check_metadata, check_tensor_ranges

    check_metadata(index.metadata)
    check_tensor_ranges(index.tensors.values(), index.data_offset, index.alignment, file_size)


# ---------------------------------------------------------------- the bounded parser


def read_index(path: Path) -> GGUFIndex:
    """Parse and validate a GGUF header; every problem is one ModelFormatError naming the file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)  # slices of it decode without copying
            try:
                index = _parse(_Cursor(view))
            finally:
                view.release()
            _validate(index, len(mm))
            return index
    except ModelFormatError as e:
        from localllm.gguf_check import one_line

        raise ModelFormatError(one_line(f"{path.name}: {e}")) from None
    except (OSError, ValueError) as e:  # e.g. an empty file cannot be mapped
        raise ModelFormatError(f"cannot read {path.name}: {e}") from None


class _Cursor:
    """Little-endian reads from a buffer; a read past its end is a ModelFormatError, never a crash."""

    def __init__(self, buf: Any, pos: int = 0):
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def take(self, n: int, what: str) -> int:
        """Advance past n bytes; returns where they start."""
        if n > self.end - self.pos:
            raise ModelFormatError(
                f"the file is truncated or corrupt: {what} needs {n:,} bytes at byte {self.pos:,} "
                f"but only {self.end - self.pos:,} remain"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, max_bytes: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if max_bytes is not None and n > max_bytes:
            raise ModelFormatError(f"{what} is {n:,} bytes long; at most {max_bytes:,} expected")
        start = self.take(n, what)
        return _decode(self.buf, start, start + n, what)

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count read from the file, refused when its items could not fit in the bytes left."""
        n = self.u64(what)
        if n * min_item_bytes > self.end - self.pos:
            raise ModelFormatError(
                f"{what} is {n:,}, more than the {self.end - self.pos:,} bytes left in the file can hold"
            )
        return n


def _parse(cur: _Cursor) -> GGUFIndex:
    from localllm.gguf_check import check_tensor_ranges

    cur.take(4, "the magic")
    version = cur.u32("the version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ModelFormatError(f"GGUF version {version} is not supported{hint}; expected 2 or 3")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.count("the metadata key count", MIN_KV_BYTES)
    metadata = _read_metadata(cur, n_kv)
    if n_tensors * MIN_TENSOR_INFO_BYTES > cur.end - cur.pos:
        raise ModelFormatError(f"the tensor count {n_tensors:,} is more than the file can hold")
    alignment = _alignment(metadata)
    infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    if infos and data_offset > cur.end:
        raise ModelFormatError("the file is truncated: it ends before its tensor data section")
    tensors = _tensor_table(infos, data_offset)
    check_tensor_ranges(tensors.values(), data_offset, alignment, cur.end)
    # only now, with the whole header in bounds, do vocabularies become (many, larger) python objects
    for key, value in metadata.items():
        if isinstance(value, _StringArray):
            metadata[key] = _read_string_array(_Cursor(cur.buf, value.start), value.count, value.what)
    vocab = metadata.get("tokenizer.ggml.tokens")
    if isinstance(vocab, TextTable):
        vocab.build_index()  # tokenizers look texts up: the buckets are cached with the index
    return GGUFIndex(metadata, tensors, data_offset, alignment, _digest(cur.buf, min(data_offset, cur.end)))


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}", MAX_KEY_BYTES)
        value = _read_value(cur, cur.u32(f"the type of '{key}'"), f"'{key}'")
        if key in metadata:
            raise ModelFormatError(f"metadata key '{key}' appears twice")
        metadata[key] = value
    return metadata


def _read_value(cur: _Cursor, vtype: int, what: str) -> Any:
    if vtype == GGUF_STRING:
        return cur.string(f"the value of {what}")
    if vtype == GGUF_ARRAY:
        return _read_array(cur, what)
    fmt = SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise ModelFormatError(f"metadata {what} has unknown value type {vtype}")
    return cur.scalar(fmt, f"the value of {what}")


def _read_array(cur: _Cursor, what: str) -> Any:
    item_type = cur.u32(f"the item type of {what}")
    if item_type == GGUF_STRING:
        n, start = cur.count(f"the length of {what}", 8), cur.pos
        _read_strings(cur, n, what, decode=False)
        return _StringArray(start, n, what)
    fmt = SCALAR_FORMATS.get(item_type)
    if fmt is None:  # nested arrays included: no model uses them and llama.cpp rejects them too
        raise ModelFormatError(f"metadata {what} is an array of unsupported item type {item_type}")
    dtype = np.dtype(fmt)
    n = cur.count(f"the length of {what}", dtype.itemsize)
    start = cur.take(n * dtype.itemsize, what)
    if dtype.kind == "b":  # any non-zero byte is true; a numpy bool array holds only 0 and 1
        values = np.frombuffer(cur.buf, np.uint8, n, start) != 0
    else:
        values = np.frombuffer(cur.buf, dtype, n, start).copy()
    # a long array stays numpy: 1 byte a bool, not a list's 8-byte pointers (and 28-byte ints)
    return values.tolist() if n <= SMALL_ARRAY else values


@dataclass(frozen=True, slots=True)
class _StringArray:
    """A string array whose bounds were checked, its strings not decoded yet."""

    start: int
    count: int
    what: str


def _read_string_array(cur: _Cursor, n: int, what: str) -> list[str] | TextTable:
    """A short array as a list; a vocabulary-sized one as a TextTable (one blob, not n objects)."""
    if n < TEXT_TABLE_MIN:
        return _read_strings(cur, n, what)
    starts = array("q")
    first = cur.pos + 8
    _read_strings(cur, n, what, decode=False, starts=starts)
    table = _text_table(cur.buf, np.frombuffer(starts, np.int64), cur.pos)
    if table is None:  # a string is not valid UTF-8: the string-by-string reader names it
        return _read_strings(_Cursor(cur.buf, first - 8), n, what)
    return table


def _text_table(buf: Any, starts: np.ndarray, end: int) -> TextTable | None:
    """The strings at `starts` (each after its 8-byte length; the last ends at `end`) as one blob."""
    first = int(starts[0])
    region = np.frombuffer(buf, np.uint8, end - first, first)
    keep = np.ones(len(region), bool)  # drop the 8-byte length in front of strings 1..n-1
    for k in range(8):
        keep[starts[1:] - (first + 8 - k)] = False
    ends = np.cumsum(np.diff(starts, append=end + 8) - 8)
    return TextTable.from_utf8(region[keep].tobytes(), ends)


def _read_strings(
    cur: _Cursor, n: int, what: str, decode: bool = True, starts: array | None = None
) -> list[str]:
    # the hot loop of a vocabulary (up to ~262k strings), so the cursor's checks are inlined
    buf, pos, end, out = cur.buf, cur.pos, cur.end, []
    unpack = struct.Struct("<Q").unpack_from
    for i in range(n):
        length = unpack(buf, pos)[0] if end - pos >= 8 else end
        pos += 8
        if length > end - pos:
            raise ModelFormatError(
                f"the file is truncated or corrupt: string {i} of {what} runs past its end"
            )
        if decode:
            out.append(_decode(buf, pos, pos + length, what, i))
        elif starts is not None:
            starts.append(pos)
        pos += length
    cur.pos = pos
    return out


def _decode(buf: Any, start: int, end: int, what: str, item: int | None = None) -> str:
    # Strict UTF-8, as the old reader was. A long string that is not plain ASCII is first checked in
    # chunks, so a damaged one costs one chunk of memory, not a file-sized str plus its copy in the
    # exception (and a str can take up to 4 bytes per character).
    long = end - start > DECODE_CHUNK
    if (
        not long
        or not np.frombuffer(buf, np.uint8, end - start, start).max() >> 7
        or _is_utf8(buf, start, end)
    ):
        try:
            return str(buf[start:end], "utf-8")
        except UnicodeDecodeError:
            pass  # raised below, so no traceback keeps a slice of the mapped file alive
    raise ModelFormatError(f"{what if item is None else f'string {item} of {what}'} is not valid UTF-8")


def _is_ascii(buf: Any, start: int, end: int) -> bool:
    return not int(np.frombuffer(buf, np.uint8, end - start, start).max()) >> 7


def _is_utf8(buf: Any, start: int, end: int) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for at in range(start, end, DECODE_CHUNK):
            stop = min(at + DECODE_CHUNK, end)
            decoder.decode(buf[at:stop], final=stop == end)
    except UnicodeDecodeError:
        return False
    return True


def _alignment(metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_ALIGNMENT
    if not ok or value & (value - 1):
        raise ModelFormatError(f"metadata key 'general.alignment' is {value!r}; expected a power of two")
    return value


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    from localllm.gguf_check import MAX_DIMS

    name = cur.string(f"the name of tensor {i}", MAX_NAME_BYTES)
    n_dims = cur.u32(f"the dimension count of tensor '{name}'")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelFormatError(f"tensor '{name}' has {n_dims} dimensions; expected 1 to {MAX_DIMS}")
    dims = tuple(cur.u64(f"a dimension of tensor '{name}'") for _ in range(n_dims))
    ggml_type = cur.u32(f"the type of tensor '{name}'")
    offset = cur.u64(f"the offset of tensor '{name}'")
    return name, tuple(reversed(dims)), ggml_type, offset  # GGUF lists ne[0] (the row length) first


def _tensor_table(
    infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int
) -> dict[str, TensorInfo]:
    from localllm.gguf_check import tensor_nbytes

    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        if name in tensors:
            raise ModelFormatError(f"tensor '{name}' appears twice")
        nbytes = tensor_nbytes(name, ggml_type, shape)
        tensors[name] = TensorInfo(name, ggml_type, shape, data_offset + offset, nbytes)
    return tensors
