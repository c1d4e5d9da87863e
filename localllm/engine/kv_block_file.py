"""One KV block in one file: the disk tier's format, written whole and checked whole before use.

    header (72 bytes): magic, format version, token count, model fingerprint, block key,
                       key bytes, value bytes, checksum
    token ids (int32 little-endian), zero-padded to 64 bytes
    keys, then values: each layer's (block_size, kv_heads, head_dim) rows, as the KV pool holds them

A file is used only when its size is exactly what the header says, the header names this model and the
block asked for, its token ids are the block's, and the checksum over everything after the header
matches. The checksum (two 64-bit reductions, a wrapping sum and an xor, over the payload as words,
digested with its length) runs at memory speed where a CRC of a 50 MB prefix took ~50 ms here. It is not
cryptographic: any single flipped bit, truncation, or zeroed or foreign stretch changes it; two flips of
one bit position in opposite directions in two words would not (the names, sizes, tokens and model are
checked exactly, so only the K/V numbers themselves could be off that way). Reading reads the whole
file into a buffer the reader keeps (BlockReader), checks it there, and the pool copies from it.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from localllm.engine.block_identity import KEY_BYTES, token_bytes

MAGIC = b"LLKVBLK\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct(f"<8sII{KEY_BYTES}s{KEY_BYTES}sQQQ")  # 72 bytes
ALIGN = 64  # the token ids' padding: the pool's rows then start 8-byte aligned


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What one block of a pool is: keys' and values' per-block shape and host element type."""

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    k_dtype: np.dtype
    v_dtype: np.dtype

    @property
    def k_count(self) -> int:
        return math.prod(self.k_shape)

    @property
    def v_count(self) -> int:
        return math.prod(self.v_shape)

    @property
    def k_bytes(self) -> int:
        return self.k_count * self.k_dtype.itemsize

    @property
    def v_bytes(self) -> int:
        return self.v_count * self.v_dtype.itemsize

    def file_size(self, num_tokens: int) -> int:
        return HEADER.size + _padded(4 * num_tokens) + self.k_bytes + self.v_bytes


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def checksum(payload: memoryview | bytes) -> int:
    """The payload's 64-bit words' wrapping sum and xor (tail bytes zero-padded) and its length, digested
    together (a single flipped bit always changes the xor; the digest keeps either change visible)."""
    whole = len(payload) // 8 * 8
    words = np.frombuffer(payload, dtype="<u8", count=whole // 8)
    total = int(np.add.reduce(words, dtype=np.uint64)) if whole else 0
    mixed = int(np.bitwise_xor.reduce(words)) if whole else 0
    summary = struct.pack("<QQQ", total, mixed, len(payload)) + bytes(payload[whole:])
    return int.from_bytes(hashlib.blake2b(summary, digest_size=8).digest(), "little")


def encode(fingerprint: bytes, key: bytes, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> list:
    """The file's parts, in order (written one after the other: no joined copy of the block)."""
    tokens = token_bytes(token_ids)
    tokens += b"\0" * (_padded(len(tokens)) - len(tokens))
    kb, vb = np.ascontiguousarray(k).data.cast("B"), np.ascontiguousarray(v).data.cast("B")
    total = _sum_parts(tokens, kb, vb)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, len(token_ids), fingerprint, key, len(kb), len(vb), total)
    return [head, tokens, kb, vb]


def _sum_parts(tokens: bytes, kb: memoryview, vb: memoryview) -> int:
    """checksum() of the three parts joined (on the writer thread: never the step's time)."""
    joined = bytearray(len(tokens) + len(kb) + len(vb))
    joined[: len(tokens)] = tokens
    joined[len(tokens) : len(tokens) + len(kb)] = kb
    joined[len(tokens) + len(kb) :] = vb
    return checksum(memoryview(joined))


class BadBlockFile(Exception):
    """A block file that must not be used (and is deleted): the reason says why."""


class BlockReader:
    """Reads block files of one model and shape into one reusable buffer and checks them whole: one
    read per file (a mapping per file cost twice as much: mmap, populate, unmap), then the checks, then
    the keys and values are viewed in the buffer. One reader per thread."""

    def __init__(self, fingerprint: bytes, shape: BlockShape):
        self.fingerprint, self.shape = fingerprint, shape
        self._buffer = memoryview(bytearray(0))

    def read(self, path: str, key: bytes, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, float]:
        """The checked file's keys and values (views valid until the next read) and its mtime.
        FileNotFoundError when there is none; BadBlockFile when it fails a check."""
        shape = self.shape
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            size = _check_size(st.st_size, len(token_ids), shape)
            view = self._view(size)
            _read_whole(f, view)
        _check_header(view, self.fingerprint, key, token_ids, shape)
        start = HEADER.size + _padded(4 * len(token_ids))
        k = np.frombuffer(view, shape.k_dtype, shape.k_count, start).reshape(shape.k_shape)
        v = np.frombuffer(view, shape.v_dtype, shape.v_count, start + shape.k_bytes)
        return k, v.reshape(shape.v_shape), st.st_mtime

    def _view(self, size: int) -> memoryview:
        if len(self._buffer) < size:
            self._buffer = memoryview(bytearray(size))
        return self._buffer[:size]


def _read_whole(f: BinaryIO, view: memoryview) -> None:
    """Fill `view` from f (a raw file may return less than asked per call)."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise BadBlockFile(f"truncated while read ({done} of {len(view)} bytes)")
        done += n


def _check_size(size: int, num_tokens: int, shape: BlockShape) -> int:
    expected = shape.file_size(num_tokens)
    if size != expected:
        raise BadBlockFile(f"{size} bytes, not {expected}")
    return size


def _check_header(
    data: memoryview, fingerprint: bytes, key: bytes, token_ids: Sequence[int], shape: BlockShape
) -> None:
    magic, version, n, fp, file_key, kb, vb, total = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BadBlockFile("not a block file of this format")
    if fp != fingerprint:
        raise BadBlockFile("written for another model or numerics")
    if file_key != key or n != len(token_ids) or (kb, vb) != (shape.k_bytes, shape.v_bytes):
        raise BadBlockFile("another block's file")
    tokens = token_bytes(token_ids)
    if data[HEADER.size : HEADER.size + len(tokens)] != tokens:
        raise BadBlockFile("other token ids")
    if checksum(data[HEADER.size :]) != total:
        raise BadBlockFile("checksum mismatch")
