"""Stable block identity: the key that names a full KV block on every run, in every process.

A block's key is a 128-bit BLAKE2b digest of its parent block's key and its token ids (little-endian
int32), the first block's parent being the model fingerprint. So a key names the block's whole prefix,
and two processes (or two runs) computing the same tokens of the same model with the same numerics
agree on it; Python's `hash()` did neither (salted per process for str, and 64 bits). The fingerprint
digests what decides the K/V bytes: the model file (its header digest, size and a sample of its
tensor data, read in well under a millisecond), the context length (rope scaling may depend on it),
the KV layout and element types, the block size, and the backend's numerics (its kernels and CPU).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.engine.kv_cache import KVLayout
    from localllm.loading.file import GGUFFile

KEY_BYTES = 16
# Bump when what a key or fingerprint covers changes: old disk blocks are then never matched.
IDENTITY_VERSION = 1
SAMPLES_PER_FILE = 32  # tensor-data chunks read per model file for the fingerprint
SAMPLE_BYTES = 4096


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (ids are below 2**31 in every vocabulary)."""
    ids = array("i", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def block_hash(parent: bytes | None, token_ids: Sequence[int], root: bytes = b"") -> bytes:
    """The key of a block holding `token_ids` after the block keyed `parent` (None: the first block,
    whose parent is `root`, the model fingerprint)."""
    digest = hashlib.blake2b(parent if parent is not None else root, digest_size=KEY_BYTES)
    digest.update(token_bytes(token_ids))
    return digest.digest()


def model_fingerprint(
    gguf: GGUFFile, backend: Backend, layout: KVLayout, max_model_len: int, block_size: int
) -> bytes:
    """The root key of a model's blocks: equal exactly when cached K/V bytes can be shared."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=b"localllm-kv")
    described = (
        f"v{IDENTITY_VERSION}|{backend.numerics()}|ctx={max_model_len}|bs={block_size}|"
        f"{layout.n_layers}x{layout.kv_heads}x{layout.head_dim}|{layout.cache_types[0]},{layout.cache_types[1]}"
    )
    digest.update(described.encode())
    for shard, header in zip(gguf.shards, gguf.header_digests, strict=True):
        digest.update(f"|{header}|{shard.size}|".encode())
        digest.update(_data_sample(shard.path, shard.data_offset, shard.size))
    return digest.digest()


def _data_sample(path, start: int, end: int) -> bytes:
    """SAMPLES_PER_FILE chunks spread evenly over a file's tensor data: two files with one header (a
    fine-tune of the same shapes) differ there."""
    span = max(end - start - SAMPLE_BYTES, 0)
    with open(path, "rb") as f:
        chunks = []
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // max(SAMPLES_PER_FILE - 1, 1))
            chunks.append(f.read(SAMPLE_BYTES))
    return b"".join(chunks)
