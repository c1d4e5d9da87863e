"""A long list of strings (a vocabulary) stored as one UTF-8 blob and its offsets, found by text.

262,144 Python strings take ~24 MiB (Gemma 3's vocabulary: a str costs 50-80 bytes of header before
its text) and a dict from them to ids ~15 MiB more; the same texts as UTF-8 in one bytes object plus
4-byte offsets take ~3.5 MiB, and hash buckets of ids (`ids_of`) ~3 MiB. `TextTable` reads like a
list of str (len, indexing, slicing, iteration, ==), building each str on demand.

The buckets hash the UTF-8 bytes with CRC-32: unlike Python's hash() it is the same in every process,
so a table pickled with its buckets (the GGUF index cache) needs no rebuild at load.
"""

from __future__ import annotations

import codecs
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["TextTable"]

_CHECK_CHUNK = 1 << 20  # bytes of the blob validated at a time
_crc32 = zlib.crc32


class TextTable(Sequence[str]):
    """Immutable texts: text i is blob[ends[i-1]:ends[i]] decoded as UTF-8 (checked when built)."""

    __slots__ = ("blob", "ends", "_buckets")

    def __init__(self, blob: bytes, ends: array, buckets: tuple[array, array] | None = None) -> None:
        self.blob = blob
        self.ends = ends  # array of ints: ends[i] = end of text i; text 0 starts at 0
        self._buckets = buckets  # (ids by bucket, where each bucket starts), built at first lookup

    @classmethod
    def from_strings(cls, texts: Iterable[str]) -> TextTable:
        parts = [t.encode("utf-8", "surrogatepass") for t in texts]
        return cls(b"".join(parts), _offsets(np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)))))

    @classmethod
    def from_utf8(cls, blob: bytes, ends: np.ndarray) -> TextTable | None:
        """The table of texts blob[ends[i-1]:ends[i]], or None when one of them is not valid UTF-8."""
        if not _valid_pieces(blob, ends):
            return None
        return cls(blob, _offsets(ends))

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if i.__class__ is not int:  # (a slice; the int test first: this is the hot path)
            if isinstance(i, slice):
                return [self[k] for k in range(*i.indices(len(self)))]
            i = i.__index__()
        ends = self.ends
        end = ends[i]  # IndexError past the end, negative indices count from it
        if i < 0:
            i += len(ends)
        return str(self.blob[ends[i - 1] if i else 0 : end], "utf-8", "surrogatepass")

    def raw(self, i: int) -> bytes:
        """Text i as UTF-8."""
        ends = self.ends
        end = ends[i]  # IndexError past the end, negative indices count from it
        if i < 0:
            i += len(ends)
        return self.blob[ends[i - 1] if i else 0 : end]

    def __iter__(self) -> Iterator[str]:
        blob, start = self.blob, 0
        for end in self.ends:
            yield str(blob[start:end], "utf-8", "surrogatepass")
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TextTable):
            return self.blob == other.blob and list(self.ends) == list(other.ends)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by content, as a list does

    def __repr__(self) -> str:
        return f"TextTable({len(self)} texts, {len(self.blob):,} bytes)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TextTable, (self.blob, self.ends, self._buckets))

    def byte_lengths(self) -> np.ndarray:
        """Each text's length in UTF-8 bytes."""
        return np.diff(np.asarray(self.ends, np.int64), prepend=0)

    def joined(self, start: int, stop: int, sep: str) -> str:
        """sep + sep.join(self[start:stop]) for a one-byte sep, in one decode of the blob."""
        ends = np.asarray(self.ends[start:stop], np.int64)
        if len(ends) == 0:
            return ""
        lo = self.ends[start - 1] if start else 0
        data = np.frombuffer(self.blob, np.uint8, int(ends[-1]) - lo, lo)
        cuts = np.concatenate(([0], ends[:-1] - lo))
        return str(np.insert(data, cuts, ord(sep)).tobytes(), "utf-8", "surrogatepass")

    def ids_of(self, text: str) -> list[int]:
        """Every i with self[i] == text, ascending."""
        ids, starts = self._buckets or self.build_index()
        data = text.encode("utf-8", "surrogatepass")
        b = _crc32(data) & (len(starts) - 2)
        blob, ends, size = self.blob, self.ends, len(data)
        found = []
        for j in range(starts[b], starts[b + 1]):
            i = ids[j]
            end = ends[i]
            if (ends[i - 1] if i else 0) == end - size and blob[end - size : end] == data:
                found.append(i)
        return found

    def find(self, text: str) -> int | None:
        """The first i with self[i] == text; None if there is none (the hot path of tokenizing)."""
        ids, starts = self._buckets or self.build_index()
        data = text.encode("utf-8", "surrogatepass")
        b = _crc32(data) & (len(starts) - 2)
        lo, hi = starts[b], starts[b + 1]
        if lo == hi:  # most pairs a tokenizer tries are no token
            return None
        blob, ends, size = self.blob, self.ends, len(data)
        for j in range(lo, hi):
            i = ids[j]
            end = ends[i]
            if (ends[i - 1] if i else 0) == end - size and blob[end - size : end] == data:
                return i
        return None

    def build_index(self) -> tuple[array, array]:
        """The hash buckets of `ids_of` (~1-2 per text; ~3 MiB for 262k texts)."""
        if self._buckets is None:
            n, blob, ends = len(self), self.blob, self.ends
            crc = zlib.crc32
            hashes = np.fromiter(
                (crc(blob[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)), np.int64, n
            )
            mask = (1 << max(4, n.bit_length())) - 1
            buckets = hashes & mask
            order = np.argsort(buckets, kind="stable")  # ids ascending within a bucket
            starts = np.searchsorted(buckets[order], np.arange(mask + 2))
            self._buckets = (
                array("i", order.astype(np.int32).tobytes()),
                array("i", starts.astype(np.int32).tobytes()),
            )
        return self._buckets


def _offsets(ends: np.ndarray) -> array:
    """Offsets as 4-byte ints when they fit (a blob under 2 GiB), else 8-byte."""
    code = "i" if len(ends) == 0 or int(ends[-1]) < 1 << 31 else "q"
    return array(code, np.ascontiguousarray(ends, np.dtype(code)).tobytes())


def _valid_pieces(blob: bytes, ends: np.ndarray) -> bool:
    """Every piece is valid UTF-8: the whole blob is, and no piece starts inside a character."""
    data = np.frombuffer(blob, np.uint8)
    starts = np.asarray(ends[:-1], np.int64)
    starts = starts[starts < len(data)]
    if np.any((data[starts] & 0xC0) == 0x80):
        return False
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for at in range(0, len(blob), _CHECK_CHUNK):
            stop = min(at + _CHECK_CHUNK, len(blob))
            decoder.decode(blob[at:stop], final=stop == len(blob))
    except UnicodeDecodeError:
        return False
    return True
