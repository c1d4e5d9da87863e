"""The prefix cache's disk tier on the tiny model: a restart finds the blocks with identical logits,
damaged files are never trusted (deleted and recomputed), the byte budget holds, and writers share the
directory safely. LOCALLLM_KV_DAMAGED=1000 runs the damaged-file test on 1,000 files (default 200)."""

from __future__ import annotations

import gc
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.kv_disk import SUFFIX, KVDiskTier
from localllm.sampling_params import SamplingParams

LOGPROBS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=10)
FINGERPRINT_AT = 16  # after the magic, version and token count
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)


def make(path, index_dir, disk: Path | None = None, mb: int = 64, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    extra = {"kv_disk_mb": mb, "kv_disk_dir": disk} if disk is not None else {}
    return LLMEngine(
        EngineConfig(model=str(path), backend="numba", index_dir=index_dir, threads=1, **kw, **extra)
    )


def tier_of(engine: LLMEngine) -> KVDiskTier:
    tier = engine.block_manager.tier
    assert isinstance(tier, KVDiskTier)
    return tier


def result(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = LOGPROBS) -> list:
    """Per prompt: its cached tokens and every generated token's id, logprob and top alternatives."""
    outs = engine.generate(prompts, params)
    return [(o.cached_tokens, [(t.token_id, t.logprob, t.top) for t in o.logprobs]) for o in outs]


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_restart_restores_the_prompt_with_identical_logits(tiny_model_path, index_dir, tmp_path):
    prompt = np.random.default_rng(1).integers(3, 250, 150).tolist()
    cold = result(make(tiny_model_path, index_dir), [prompt])[0]  # no disk tier at all
    first = make(tiny_model_path, index_dir, tmp_path)
    assert result(first, [prompt])[0] == cold
    assert tier_of(first).flush() and tier_of(first).stats.writes == (150 + 3) // 16
    second = make(tiny_model_path, index_dir, tmp_path)  # a new process's view: nothing in memory
    cached, tokens = result(second, [prompt])[0]
    assert cached == 144 and second.block_manager.num_disk_hits == 144
    assert tokens == cold[1]  # the same ids, logprobs and alternatives, bit for bit
    assert tier_of(second).stats.hits == 9 and tier_of(second).stats.bad == 0
    assert second.stats().kv_disk.hits == 9 and make(tiny_model_path, index_dir).stats().kv_disk is None


def test_metrics_show_the_disk_tier():
    from localllm.engine.engine import EngineStats
    from localllm.engine.kv_disk import DiskStats
    from localllm.server.metrics import ServerMetrics

    disk = DiskStats(hits=7, writes=9, dropped=1, bad=2, evicted=3)
    text = ServerMetrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, None, disk)).render()[0].decode()
    for name, value in (("hits", 7), ("writes", 9), ("dropped", 1), ("bad_files", 2), ("evictions", 3)):
        assert f'localllm:kv_disk_{name}_total{{model_name="default"}} {value}.0' in text


def test_the_disk_tier_is_off_unless_asked_for(tiny_model_path, index_dir):
    assert make(tiny_model_path, index_dir).block_manager.tier is None


def damage(path: Path, how: str, other: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: rng.randrange(len(data))]
    elif how == "flipped":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "wrong key":
        data = bytearray(other.read_bytes())  # another block's whole file under this name
    elif how == "wrong model":
        data[FINGERPRINT_AT : FINGERPRINT_AT + 16] = bytes(16)
    path.write_bytes(bytes(data))


def test_damaged_files_are_deleted_and_recomputed(tiny_model_path, index_dir, tmp_path):
    """One block per prompt (5 tokens, block size 4), so every file is the first its prompt looks up."""
    n = int(os.environ.get("LOCALLLM_KV_DAMAGED", "200"))
    rng = random.Random(3)
    prompts = [[3 + i % 240, 3 + i // 240, 7, 11, 13] for i in range(n)]
    kw = {"block_size": 4, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
    expected = result(make(tiny_model_path, index_dir, **kw), prompts, ONE)
    writer = make(tiny_model_path, index_dir, tmp_path, **kw)
    assert result(writer, prompts, ONE) == expected and tier_of(writer).flush()
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == n
    kinds = ("truncated", "flipped", "wrong key", "wrong model")
    for i, path in enumerate(files):
        damage(path, kinds[i % 4], files[(i + 1) % n], rng)
    reader = make(tiny_model_path, index_dir, tmp_path, **kw)
    assert result(reader, prompts, ONE) == expected  # no crash, no wrong output, nothing taken as cached
    stats = tier_of(reader).stats
    assert (stats.bad, stats.hits) == (n, 0)
    assert tier_of(reader).flush() and tier_of(reader).stats.writes == n  # each recomputed and rewritten
    again = make(tiny_model_path, index_dir, tmp_path, **kw)
    restored = result(again, prompts, ONE)
    assert [c for c, _ in restored] == [4] * n and [t for _, t in restored] == [t for _, t in expected]


def test_disk_use_stays_within_the_budget_least_recently_used_out(tiny_model_path, index_dir, tmp_path):
    engine = make(tiny_model_path, index_dir, tmp_path, mb=1, block_size=4)
    tier = tier_of(engine)
    file_size = tier.shape.file_size(4)
    tier.budget.limit = 40 * file_size  # a budget of 40 blocks' files
    rng = np.random.default_rng(5)
    keep = rng.integers(3, 250, 21).tolist()  # five blocks, used again and again
    for _ in range(30):
        engine.generate([keep, rng.integers(3, 250, 21).tolist()], ONE)
        tier.flush()
        assert disk_bytes(tmp_path) <= tier.budget.limit
        engine.block_manager.hash_to_block_id.clear()  # memory forgets: the next lookups go to disk
        for block in engine.block_manager.blocks:
            block.hash = None
    assert tier.stats.evicted > 0
    fresh = make(tiny_model_path, index_dir, tmp_path, mb=1, block_size=4)
    assert result(fresh, [keep], ONE)[0][0] == 20  # the block chain in use survived every eviction


def test_two_writers_in_one_directory_leave_only_whole_files(tiny_model_path, index_dir, tmp_path):
    """Two engines (two writer threads, as two processes would be) write the same blocks at once."""
    prompts = [np.random.default_rng(i).integers(3, 250, 70).tolist() for i in range(6)]
    engines = [make(tiny_model_path, index_dir, tmp_path) for _ in range(2)]
    for p in prompts:
        for engine in engines:
            engine.generate([p], ONE)
    assert all(tier_of(e).flush() for e in engines)
    assert not list(tmp_path.rglob("*.tmp"))
    reader = make(tiny_model_path, index_dir, tmp_path)
    reader.generate(prompts, ONE)
    stats = tier_of(reader).stats
    assert stats.bad == 0 and stats.hits == 6 * 4


def test_a_full_write_queue_drops_blocks_and_never_waits(tiny_model_path, index_dir, tmp_path, monkeypatch):
    engine = make(tiny_model_path, index_dir, tmp_path)
    tier = tier_of(engine)
    slow = tier._write

    def stalled(*item):
        time.sleep(0.2)
        slow(*item)

    monkeypatch.setattr(tier, "_write", stalled)
    prompt = np.random.default_rng(9).integers(3, 250, 200).tolist()
    tier._queue.maxsize = 2
    engine.generate([prompt], ONE)
    assert tier._queue.unfinished_tasks > 0  # the request ended with writes still queued: none waited for
    assert tier.stats.dropped > 0
    assert tier.flush() and tier.stats.writes + tier.stats.dropped == 200 // 16


def test_other_backends_keep_their_own_files(tiny_model_path, index_dir, tmp_path):
    """The numerics are in the fingerprint: the numpy reference never reads the numba kernels' blocks."""
    prompt = np.random.default_rng(2).integers(3, 250, 40).tolist()
    first = make(tiny_model_path, index_dir, tmp_path)
    first.generate([prompt], ONE)
    tier_of(first).flush()
    other = LLMEngine(
        EngineConfig(model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1,
                     kv_disk_mb=64, kv_disk_dir=tmp_path)
    )  # fmt: skip
    assert other.generate([prompt], ONE)[0].cached_tokens == 0
    assert tier_of(other).stats.bad == 0  # another directory: nothing looked at, nothing deleted


def test_the_checksum_sees_every_single_bit_flip_and_a_truncation():
    from localllm.engine.kv_block_file import checksum

    payload = bytearray(np.random.default_rng(4).integers(0, 256, 203, dtype=np.uint8).tobytes())
    original, damaged = checksum(bytes(payload)), []
    for i in range(len(payload) * 8):
        payload[i // 8] ^= 1 << (i % 8)
        damaged.append(checksum(bytes(payload)))
        payload[i // 8] ^= 1 << (i % 8)
    damaged.append(checksum(bytes(payload[:-1])))
    damaged.append(checksum(bytes(payload) + b"\0"))  # a zero byte more: only the length differs
    assert original not in damaged and len(damaged) == len(payload) * 8 + 2


def test_closing_the_engine_writes_out_the_queue_and_stops_the_writer(tiny_model_path, index_dir, tmp_path):
    """What the server's model pool does when it unloads a model: LLMEngine.close."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1,
                     kv_disk_mb=64, kv_disk_dir=tmp_path)
    )  # fmt: skip
    tier = tier_of(engine)
    engine.generate([np.random.default_rng(5).integers(3, 250, 40).tolist()], ONE)
    engine.close()
    assert not tier._thread.is_alive() and tier._queue.unfinished_tasks == 0
    assert tier.stats.writes == 40 // 16 == len(list(tmp_path.rglob(f"*{SUFFIX}")))
    engine.close()  # twice is harmless


def test_a_hit_renews_only_an_old_files_time(tiny_model_path, index_dir, tmp_path):
    """Other processes evict by file time: a hit renews a file older than TOUCH_SECONDS and leaves a
    younger one's time as it is (a syscall per restored block saved)."""
    from localllm.engine.kv_disk import TOUCH_SECONDS

    prompt = np.random.default_rng(6).integers(3, 250, 40).tolist()
    first = make(tiny_model_path, index_dir, tmp_path)
    first.generate([prompt], ONE)
    assert tier_of(first).flush()
    old, young = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    now = time.time()
    os.utime(old, (now - 3 * TOUCH_SECONDS, now - 3 * TOUCH_SECONDS))
    os.utime(young, (now - TOUCH_SECONDS / 2, now - TOUCH_SECONDS / 2))
    second = make(tiny_model_path, index_dir, tmp_path)
    assert second.generate([prompt], ONE)[0].cached_tokens == 32 and tier_of(second).stats.hits == 2
    assert old.stat().st_mtime >= now - 5 and young.stat().st_mtime == now - TOUCH_SECONDS / 2


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_the_pool_blocks_a_restart_restores_into_are_resident_before_the_first_request(
    tiny_model_path, index_dir, tmp_path
):
    """As many of the pool's first blocks as the directory holds files of the model are made resident
    at start (a fresh process's restores fill them), in every layer; without files, none are."""
    from resident import resident_kib

    from localllm.engine.kv_cache import PREFAULT_BLOCKS

    prompt = np.random.default_rng(7).integers(3, 250, 150).tolist()
    first = make(tiny_model_path, index_dir, tmp_path, kv_cache_mb=64)
    first.generate([prompt], ONE)
    assert tier_of(first).flush() and tier_of(first).stats.writes == 9
    del first  # (its pool's mapping could merge with the next one's: smaps would count both)
    gc.collect()
    empty = make(tiny_model_path, index_dir, tmp_path / "empty", kv_cache_mb=64)
    k = empty.kv_cache.k
    chunk = k[:, :PREFAULT_BLOCKS].nbytes // 1024
    assert chunk < k.nbytes // 1024 // 4 and resident_kib(k) < chunk // 4
    del empty, k
    gc.collect()
    restarted = make(tiny_model_path, index_dir, tmp_path, kv_cache_mb=64)
    assert chunk <= resident_kib(restarted.kv_cache.k) <= chunk + 1024
    assert restarted.generate([prompt], ONE)[0].cached_tokens == 144
