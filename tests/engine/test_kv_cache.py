"""The KV cache in f16 (the default, as in llama.cpp) or f32: conversions, kernels and pool sizing."""

from __future__ import annotations

import os

import numpy as np
import pytest
from numba import njit
from resident import resident_kib

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import ConfigError
from localllm.kernels import attention, layers
from localllm.kernels.simd import HAVE_F16C, f32_to_f16, f32_to_f16_soft


@njit(cache=True)
def _convert(x, soft, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_f16_soft(x[i]) if soft else f32_to_f16(x[i])


@pytest.mark.parametrize("soft", [True, False])
def test_f32_to_f16_rounds_like_numpy(soft: bool) -> None:
    """Nearest-even, subnormals, overflow to inf, inf and nan: the same bits as astype(float16)."""
    if not soft and not HAVE_F16C:
        pytest.skip("this CPU has no F16C: the portable conversion is the one in use")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(50_000).astype(np.float32) * np.float32(10) ** rng.integers(-9, 6, 50_000)
    edges = [0.0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, np.inf, -np.inf, np.nan, 6e-8, 2.98e-8, 6.1e-5]
    x = np.concatenate([x.astype(np.float32), np.array(edges, np.float32)])
    out = np.empty(x.shape, np.uint16)
    _convert(x, soft, out)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out, expected)


def test_attention_over_an_f16_cache_equals_f32_attention_over_the_rounded_values() -> None:
    """Reads convert exactly, so the only difference f16 makes is the rounding at the store."""
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((2, 40, 2, 16)).astype(np.float32)
    q = rng.standard_normal((40, 4, 16)).astype(np.float32)
    tables = np.array([[2, 0, 1]], np.int64)  # 16-token blocks, out of order
    slots = tables[0, np.arange(40) // 16] * 16 + np.arange(40) % 16
    half = [np.zeros((3, 16, 2, 16), np.uint16) for _ in range(2)]
    full = [np.zeros((3, 16, 2, 16), np.float32) for _ in range(2)]
    layers.store_kv_rows(*half, k, v, slots)
    rounded = [a.astype(np.float16).astype(np.float32) for a in (k, v)]
    layers.store_kv_rows(*full, *rounded, slots)
    np.testing.assert_array_equal(half[0].view(np.float16).astype(np.float32), full[0])
    qsl, ctx = np.array([0, 40], np.int64), np.array([40], np.int64)
    outs = [np.empty_like(q) for _ in range(2)]
    attention.paged_attention_serial(q, *half, qsl, ctx, tables, 0.25, 0, 0.0, outs[0])
    attention.paged_attention_serial(q, *full, qsl, ctx, tables, 0.25, 0, 0.0, outs[1])
    np.testing.assert_array_equal(outs[0], outs[1])


def _engine(path, cache: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), threads=2, cache_type_k=cache, cache_type_v=cache, **kw))


def test_f16_cache_halves_the_pool_and_stays_close_to_f32(tiny_model_path) -> None:
    f16, f32 = _engine(tiny_model_path, "f16", kv_cache_mb=1), _engine(tiny_model_path, "f32", kv_cache_mb=1)
    assert f16.kv_cache.k.dtype == np.uint16 and f32.kv_cache.k.dtype == np.float32
    assert f32.kv_bytes_per_token == 2 * f16.kv_bytes_per_token
    assert f16.kv_capacity_tokens == 2 * f32.kv_capacity_tokens
    ids = list(range(5, 60))
    a, b = np.asarray(score_tokens(f16, ids)), np.asarray(score_tokens(f32, ids))
    assert np.abs(a - b).max() / np.abs(b).max() < 0.01
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9


def test_unsupported_cache_types_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="cache-type-k q4_0 is not supported"):
        EngineConfig(model="x.gguf", cache_type_k="q4_0")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_short_request_makes_only_its_blocks_resident(tiny_model_path) -> None:
    """The pool is mapped lazily and without huge pages: a 64 MiB pool (4,096 blocks) that serves one
    short prompt holds a few KiB per layer, not 2 MiB per layer (NumPy asks for huge pages)."""
    eng = _engine(tiny_model_path, "f16", kv_cache_mb=64)
    k = eng.kv_cache.k
    assert k.nbytes >= 32 * 2**20 and k.flags.writeable and k.flags.c_contiguous
    score_tokens(eng, list(range(5, 40)))
    resident = resident_kib(k)  # (before the count below reads, and so maps, every page)
    written = int(np.count_nonzero(k.reshape(k.shape[0], k.shape[1], -1).any(-1)))  # (layer, block) pairs
    assert written > 0
    assert resident <= written * (k[0, 0].nbytes // 1024 + 8) + 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_restore_prefaults_its_chunk_of_the_pool_in_one_go(tiny_model_path) -> None:
    """Before the disk tier writes a block, its chunk of PREFAULT_BLOCKS blocks becomes resident in every
    layer (one madvise each, no fault per page); blocks written nowhere else stay unmapped."""
    from localllm.engine.kv_cache import PREFAULT_BLOCKS

    eng = _engine(tiny_model_path, "f16", kv_cache_mb=64)
    kv = eng.kv_cache
    chunk = kv.k[:, :PREFAULT_BLOCKS].nbytes // 1024  # KiB, every layer
    assert resident_kib(kv.k) < chunk // 4
    k, v = kv.read_block(3)
    kv.write_block(PREFAULT_BLOCKS + 3, k + 1, v)
    assert chunk <= resident_kib(kv.k) <= chunk + 1024
    assert (kv.k[:, PREFAULT_BLOCKS + 3] == k + 1).all()
    kv.prefault_blocks = 0
    kv.write_block(5 * PREFAULT_BLOCKS, k, v)  # off: only the written pages
    assert resident_kib(kv.k) <= chunk + 1024 + 2 * kv.k[:, 0].nbytes // 1024 + 64
