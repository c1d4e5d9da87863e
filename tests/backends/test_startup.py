"""Start-up: the disk cache of repacked weights (localllm/backends/weight_cache.py) on the tiny model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_model import write_tiny_model

from localllm.backends import weight_cache
from localllm.backends.numba_cpu import NumbaBackend
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.loading.file import GGUFFile
from localllm.models import load_model
from localllm.sampling_params import SamplingParams


@pytest.fixture
def model_path(tiny_model_path: Path, tmp_path: Path) -> Path:
    """A private copy: these tests rewrite the model file and its cache."""
    return Path(shutil.copy(tiny_model_path, tmp_path / "tiny.gguf"))


def _load(path: Path, cache_dir: Path) -> tuple[object, weight_cache.WeightCache]:
    backend = NumbaBackend(1)
    gf = GGUFFile.open(path, cache_dir)
    cache = backend.open_weight_cache(gf, cache_dir)
    model = load_model(gf, backend, weight_cache=cache)
    cache.save()
    return model, cache


def _matrices(model) -> list:
    out = [model.tok_embd]
    for x in model.layers:
        out += [x.wq, x.wk, x.wv, x.wo, x.gate, x.up, x.down]
    return out


def _same_weights(a, b) -> None:
    for wa, wb in zip(_matrices(a), _matrices(b), strict=True):
        assert (wa.kind, wa.ggml_type, wa.n, wa.k) == (wb.kind, wb.ggml_type, wb.n, wb.k)
        assert np.array_equal(np.asarray(wa.buf), np.asarray(wb.buf))


def _cache_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.wpack"))


def _no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(raw, ggml_type):
        raise AssertionError("repacked a weight the cache holds")

    monkeypatch.setattr(weight_cache, "pack_weight", refuse)


def test_second_load_reads_the_cache(model_path: Path, tmp_path: Path, monkeypatch) -> None:
    first, cache = _load(model_path, tmp_path)
    assert cache.misses == len(_matrices(first)) and len(_cache_files(tmp_path)) == 1
    _no_packing(monkeypatch)
    second, cache = _load(model_path, tmp_path)
    assert cache.misses == 0
    _same_weights(first, second)
    # memory-mapped from the cache file, not copied into the process
    assert all(isinstance(w.buf.base, np.memmap) or isinstance(w.buf, np.memmap) for w in _matrices(second))
    rng, b = np.random.default_rng(0), NumbaBackend(1)
    for wa, wb in zip(_matrices(first), _matrices(second), strict=True):
        x = rng.standard_normal((3, wa.k)).astype(np.float32)
        assert np.array_equal(b.linear(x, wa), b.linear(x, wb))


@pytest.mark.parametrize("damage", ["truncate", "header", "index", "garbage", "empty"])
def test_a_damaged_cache_is_repacked(model_path: Path, tmp_path: Path, damage: str) -> None:
    fresh, _ = _load(model_path, tmp_path)
    (path,) = _cache_files(tmp_path)
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "header":
        data = b"NOTMAGIC" + data[8:]
    elif damage == "index":  # inside the JSON index: its CRC no longer matches
        data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
    elif damage == "garbage":
        data = os.urandom(len(data))
    else:
        data = b""
    path.write_bytes(data)
    again, cache = _load(model_path, tmp_path)
    assert cache.misses == len(_matrices(again))  # nothing trusted from the damaged file
    _same_weights(fresh, again)
    _, cache = _load(model_path, tmp_path)  # ... and the file was rewritten whole
    assert cache.misses == 0


def test_a_changed_model_file_invalidates_the_cache(model_path: Path, tmp_path: Path) -> None:
    _load(model_path, tmp_path)
    old = _cache_files(tmp_path)
    write_tiny_model(model_path, seed=1)  # same path, new weights (and a new mtime)
    os.utime(model_path, ns=(1, 1))  # even were the clock too coarse to notice the rewrite
    changed, cache = _load(model_path, tmp_path)
    assert cache.misses == len(_matrices(changed))
    expected, _ = _load(model_path, tmp_path / "elsewhere")
    _same_weights(changed, expected)
    new = _cache_files(tmp_path)
    assert len(new) == 1 and new != old  # the stale file was replaced, not kept beside the new one


def test_a_changed_packing_layout_invalidates_the_cache(model_path: Path, tmp_path: Path, monkeypatch):
    _load(model_path, tmp_path)
    monkeypatch.setattr(weight_cache, "packing_digest", lambda: "another-layout")
    _, cache = _load(model_path, tmp_path)
    assert cache.misses > 0


def test_an_unwritable_cache_dir_only_costs_speed(model_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, cache = _load(model_path, blocker)  # the index and packed-weight writes both fail quietly
    assert cache.misses == len(_matrices(model))


def test_arrays_from_elsewhere_are_packed_not_cached(model_path: Path, tmp_path: Path) -> None:
    backend = NumbaBackend(1)
    gf = GGUFFile.open(model_path, tmp_path)
    raw = np.array(gf.raw("blk.0.attn_q.weight"))  # a copy: not a view of the file
    assert gf.offset_of(raw) is None
    cache = backend.open_weight_cache(gf, tmp_path)
    w = backend.prepare_weight(raw, gf.tensors["blk.0.attn_q.weight"].ggml_type, cache)
    cache.save()
    assert w.n == 64 and cache.misses == 1 and not _cache_files(tmp_path)


def test_engine_generates_the_same_tokens_from_the_cache(model_path: Path, tmp_path: Path) -> None:
    def generate() -> list[int]:
        config = EngineConfig(model=str(model_path), index_dir=tmp_path, threads=1, max_num_seqs=1)
        engine = LLMEngine(config)
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6))
        return out[0].token_ids

    first = generate()
    assert len(_cache_files(tmp_path)) == 1
    assert generate() == first


def test_the_cache_of_a_deleted_model_is_pruned(model_path: Path, tmp_path: Path) -> None:
    """A model deleted outside `rm` leaves a packed copy as large as itself: the next save removes it."""
    cache_dir = tmp_path / "cache"
    gone = Path(shutil.copy(model_path, tmp_path / "gone.gguf"))
    _load(gone, cache_dir)
    (orphan,) = _cache_files(cache_dir)
    unreadable = cache_dir / "0123456789abcdef-0123456789abcdef.wpack"
    unreadable.write_bytes(b"not a cache file")  # records no model: left alone
    gone.unlink()
    _load(model_path, cache_dir)
    kept = _cache_files(cache_dir)
    assert orphan not in kept and unreadable in kept and len(kept) == 2


def test_gathered_rows_come_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    """qwen35's q and gate rows interleave in one tensor: a second load maps them packed from the cache
    and never gathers them from the file (a copy of each plus those file pages resident)."""
    from tiny_hybrid import write_hybrid

    path = write_hybrid(tmp_path / "h.gguf", "qwen35", "Q8_0")
    first, _ = _load(path, tmp_path / "c")
    gated = [x for x in first.layers if x.wg is not None]
    assert gated, "the tiny qwen35 has no gated attention layer"
    _no_packing(monkeypatch)
    monkeypatch.setattr(np, "ascontiguousarray", lambda *a, **k: pytest.fail("gathered rows again"))
    second, cache = _load(path, tmp_path / "c")
    assert cache.misses == 0
    for a, b in zip(gated, [x for x in second.layers if x.wg is not None], strict=True):
        for wa, wb in ((a.wq, b.wq), (a.wg, b.wg)):
            assert np.array_equal(np.asarray(wa.buf), np.asarray(wb.buf))
            assert isinstance(wb.buf.base, np.memmap)


def test_cache_file_is_written_in_whole_aligned_chunks(monkeypatch):
    """The page cache's folio size follows the write's: every write but the last is a whole chunk at a
    multiple of it, and the bytes are those of writing each piece at its offset (gaps as zeros)."""
    import io

    monkeypatch.setattr(weight_cache, "_CHUNK", 64)
    writes: list[tuple[int, int]] = []

    class Recorder(io.BytesIO):
        def write(self, b) -> int:  # type: ignore[override]
            writes.append((self.tell(), len(b)))
            return super().write(b)

    rng = np.random.default_rng(0)
    pieces = [(0, rng.bytes(10)), (16, rng.bytes(100)), (128, rng.bytes(64)), (300, rng.bytes(5))]
    f = Recorder()
    out = weight_cache._ChunkWriter(f)
    for offset, data in pieces:
        out.put(offset, data)
    out.close()
    expected = bytearray(305)
    for offset, data in pieces:
        expected[offset : offset + len(data)] = data
    assert f.getvalue() == bytes(expected)
    assert all(at % 64 == 0 and n == 64 for at, n in writes[:-1]) and writes[-1] == (256, 49)
    with pytest.raises(ValueError, match="file order"):
        out.put(10, b"x")
