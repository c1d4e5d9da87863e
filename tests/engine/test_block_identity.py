"""Stable block identity: a block's key is the same in every process and run, and names exactly what
decides its K/V bytes (the model file, context, KV types, block size, backend numerics)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tiny_model import write_tiny_model

from localllm.config import EngineConfig
from localllm.engine.block_identity import block_hash, token_bytes
from localllm.engine.block_manager import BlockManager
from localllm.engine.engine import LLMEngine
from localllm.engine.sequence import Sequence
from localllm.sampling_params import SamplingParams

# The key format is frozen: disk blocks written by one version are found by the next (a change must
# bump IDENTITY_VERSION, which moves every fingerprint, instead of silently changing keys).
FIRST_KEY = "b30a3c159d7e8193559a42a84f1fcae1"  # block_hash(None, (1, 2, 3), b"")


def test_keys_are_digests_chained_from_the_root():
    assert block_hash(None, (1, 2, 3)).hex() == FIRST_KEY
    first = block_hash(None, (1, 2, 3), b"root")
    assert isinstance(first, bytes) and len(first) == 16
    assert block_hash(None, [1, 2, 3], b"root") == first  # any sequence type
    assert block_hash(None, (1, 2, 3), b"other") != first
    assert block_hash(first, (4, 5, 6), b"root") != block_hash(None, (4, 5, 6), b"root")
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"  # little-endian int32


def test_a_key_is_the_same_in_another_process():
    """Python's hash() of a tuple of ints is stable, but of strs it is salted per process: the old
    keys only looked stable. A digest is stable by construction; check it across interpreters."""
    code = (
        "from localllm.engine.block_identity import block_hash; print(block_hash(None, (7, 8), b'fp').hex())"
    )
    here = block_hash(None, (7, 8), b"fp").hex()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


def test_block_manager_keys_follow_the_fingerprint():
    keys = []
    for root in (b"model-a", b"model-a", b"model-b"):
        bm = BlockManager(8, 4, fingerprint=root)
        seq = Sequence("s", list(range(10, 19)), SamplingParams())
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        keys.append([bm.blocks[b].hash for b in seq.block_table[:2]])
    assert keys[0] == keys[1] and keys[0] != keys[2]
    assert keys[0][0] == block_hash(None, (10, 11, 12, 13), b"model-a")
    assert keys[0][1] == block_hash(keys[0][0], (14, 15, 16, 17), b"model-a")


def _fingerprint(path, index_dir, **kw) -> bytes:
    config = EngineConfig(
        model=str(path), backend=kw.pop("backend", "numpy"), index_dir=index_dir, threads=1, **kw
    )
    return LLMEngine(config).block_manager.fingerprint


def test_fingerprint_names_what_decides_the_kv_bytes(tiny_model_path, index_dir, tmp_path):
    base = _fingerprint(tiny_model_path, index_dir)
    assert base == _fingerprint(tiny_model_path, index_dir)  # another load of the same file
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_model_path.read_bytes())
    assert _fingerprint(copy, index_dir) == base  # the same bytes elsewhere: shared
    other_weights = write_tiny_model(tmp_path / "seed1.gguf", seed=1)  # same header, other tensor data
    variants = [
        _fingerprint(other_weights, index_dir),
        _fingerprint(tiny_model_path, index_dir, cache_type_k="f32"),
        _fingerprint(tiny_model_path, index_dir, ctx_size=128),
        _fingerprint(tiny_model_path, index_dir, block_size=8),
        _fingerprint(tiny_model_path, index_dir, backend="numba"),
    ]
    assert len({base, *variants}) == 1 + len(variants)


@pytest.mark.parametrize("fused", [True, False])
def test_numba_numerics_name_the_path(fused):
    from localllm.backends.numba_cpu import NumbaBackend

    backend = NumbaBackend(1)
    backend.fuse_layers = fused
    assert f"fused {fused}" in backend.numerics() and "kernels " in backend.numerics()
