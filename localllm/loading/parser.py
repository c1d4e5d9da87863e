"""The bounded GGUF header parser: metadata and tensor table, checked before anything is allocated.

Every count and string length is checked against the bytes left in the file before it allocates
anything, so a damaged or hostile file ends in one `ModelFormatError` rather than a hang or a huge
allocation; the result is then validated (`localllm.loading.checks`) before any tensor is handed out.
The `gguf` package stays the reference for the format and is what the tests write files with.
"""

from __future__ import annotations

import codecs
import hashlib
import mmap
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.loading.checks import MAX_DIMS, check_tensor_ranges, one_line, tensor_nbytes, validate_index
from localllm.loading.index import GGUFIndex, TensorInfo
from localllm.text_table import TextTable

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


def check_header(path: Path) -> None:
    if not path.exists():
        raise ModelFormatError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic)")


def digest(buf: Any, end: int) -> str:
    return hashlib.sha256(memoryview(buf)[:end]).hexdigest()


def read_index(path: Path) -> GGUFIndex:
    """Parse and validate a GGUF header; every problem is one ModelFormatError naming the file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)  # slices of it decode without copying
            try:
                index = _parse(_Cursor(view))
            finally:
                view.release()
            validate_index(index, len(mm))
            return index
    except ModelFormatError as e:
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
    return GGUFIndex(metadata, tensors, data_offset, alignment, digest(cur.buf, min(data_offset, cur.end)))


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
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
        if name in tensors:
            raise ModelFormatError(f"tensor '{name}' appears twice")
        nbytes = tensor_nbytes(name, ggml_type, shape)
        tensors[name] = TensorInfo(name, ggml_type, shape, data_offset + offset, nbytes)
    return tensors
