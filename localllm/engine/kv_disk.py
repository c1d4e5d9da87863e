"""The prefix cache's disk tier: full KV blocks kept in files, found again after a restart and shared by
every process serving the same model (`--kv-disk-mb`, `--kv-disk-dir`).

A block the engine finishes computing is copied out of the pool on the step's thread (a memcpy) and
queued; a writer thread checksums it and writes it to a temporary file that `os.replace` then names
`<dir>/<model fingerprint>/<key[:2]>/<key>.kvb` (kv_block_file.py has the format), so a reader, in this
process or another, sees a whole file or none. The queue is bounded: when the disk falls behind, blocks
are dropped (counted), never waited for. When the in-memory prefix cache misses, the block manager asks
here for the next block's key: a file is read, checked (size, header, model, key, tokens, checksum)
and copied into a free block of the pool; a file failing any check is deleted, and the block computed.
At start, as many of the pool's blocks as the directory holds files of this model are made resident,
so restoring them does not fault the pool's pages in one chunk at a time.

Every file under the directory counts against one byte budget (temporary files included, reserved
before they are written), least recently used first out; a hit renews a file's time (one over a minute
old: TOUCH_SECONDS). Each process keeps its own account of the directory and reads it again before it
evicts (at most every few seconds), so files other processes wrote or deleted are counted then.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localllm.engine.kv_block_file import BadBlockFile, BlockReader, BlockShape, encode
from localllm.engine.kv_cache import KVCache

log = logging.getLogger("localllm")

DEFAULT_SERVE_MB = 4096  # serve's budget when --kv-disk-mb is not given (at most a quarter of free space)
WRITE_QUEUE_BYTES = 64 * 2**20  # blocks waiting for the writer, at most (then dropped)
RESCAN_SECONDS = 5.0  # an eviction re-reads the directory when its last reading is older than this
TOUCH_SECONDS = 60.0  # a hit renews a file's time only when it is older than this
STALE_TEMP_SECONDS = 600  # a temporary file this old was left by a process that died mid-write
SUFFIX, TEMP_SUFFIX = ".kvb", ".tmp"


def default_dir(home: Path) -> Path:
    return home / "kv-cache"


def default_budget_mb(directory: Path) -> int:
    """serve's default: DEFAULT_SERVE_MB, or a quarter of the free space where the files would go."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free_mb = shutil.disk_usage(probe).free // 2**20
    except OSError:
        return DEFAULT_SERVE_MB
    return int(min(DEFAULT_SERVE_MB, free_mb // 4))


@dataclass(slots=True)
class DiskStats:
    """Counts since start, in blocks."""

    hits: int = 0  # restored from a file
    writes: int = 0  # files written
    dropped: int = 0  # not written: the queue was full, or the block is larger than the budget
    bad: int = 0  # files that failed a check (deleted)
    evicted: int = 0  # files deleted to stay within the budget


class DiskBudget:
    """Every block file under `root`, least recently used first, and the bytes they hold; evicts to
    keep within `limit`. Thread-safe (the step thread renews hits, the writer adds and evicts)."""

    def __init__(self, root: Path, limit: int, stats: DiskStats):
        self.root, self.limit, self.stats = root, limit, stats
        self.files: OrderedDict[str, int] = OrderedDict()  # path -> bytes, least recently used first
        self.used = 0
        self.lock = threading.Lock()
        self._read_at = 0.0
        self.on_evict = lambda path: None
        with self.lock:
            self._rescan()

    def _rescan(self) -> None:
        """Read the directory again (other processes write and delete in it too)."""
        found, now = [], time.time()
        for path in _walk(str(self.root)):
            try:
                st = os.stat(path)
            except OSError:
                continue  # deleted meanwhile
            if path.endswith(TEMP_SUFFIX) and now - st.st_mtime > STALE_TEMP_SECONDS:
                _unlink(path)
            elif path.endswith((SUFFIX, TEMP_SUFFIX)):
                found.append((st.st_mtime_ns, path, st.st_size))
        found.sort(key=lambda item: item[0])
        self.files = OrderedDict((path, size) for _, path, size in found)
        self.used = sum(self.files.values())
        self._read_at = time.monotonic()

    def reserve(self, size: int) -> bool:
        """Room for `size` more bytes (counted from now on), made by evicting the least recently used
        files; False (nothing counted) when the budget cannot hold them."""
        if size > self.limit:
            return False
        with self.lock:
            if self.used + size > self.limit and time.monotonic() - self._read_at > RESCAN_SECONDS:
                self._rescan()
            while self.used + size > self.limit and self.files:
                path, old = self.files.popitem(last=False)
                _unlink(path)
                self.used -= old
                self.stats.evicted += 1
                self.on_evict(path)
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def release(self, size: int) -> None:
        with self.lock:
            self.used -= size

    def added(self, path: str, size: int) -> None:
        """A file of `size` bytes (reserved before) now at `path`; one it replaced is no longer counted."""
        with self.lock:
            self.used -= self.files.pop(path, 0)
            self.files[path] = size

    def touch(self, path: str, mtime: float) -> None:
        """A hit: the file becomes the most recently used, here and (by its time, `mtime` until now) for
        other processes; a time under TOUCH_SECONDS old is left as it is (a syscall per block saved)."""
        with self.lock:
            if path in self.files:
                self.files.move_to_end(path)
        if time.time() - mtime > TOUCH_SECONDS:
            try:
                os.utime(path)
            except OSError:
                pass

    def forget(self, path: str) -> None:
        with self.lock:
            self.used -= self.files.pop(path, 0)


class KVDiskTier:
    """The disk tier of one model's KV pool: `contains`, `load` and `store` by block key (the block
    manager's calls, on the step's thread); writes happen on a thread of its own."""

    def __init__(self, directory: Path, budget_bytes: int, kv_cache: KVCache, fingerprint: bytes):
        self.root = Path(directory)
        self.dir = self.root / fingerprint.hex()
        self.kv, self.fingerprint = kv_cache, fingerprint
        self.stats = DiskStats()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = DiskBudget(self.root, budget_bytes, self.stats)
        self.budget.on_evict = self._evicted
        self.shape = _block_shape(kv_cache)
        self.reader = BlockReader(fingerprint, self.shape)  # the step thread's (load's)
        self._dir = str(self.dir)
        self._known: set[bytes] = set()  # keys this process wrote or read: no need to write them again
        per_block = self.shape.k_bytes + self.shape.v_bytes
        self._queue: queue.Queue = queue.Queue(maxsize=max(4, WRITE_QUEUE_BYTES // per_block))
        self._warned = 0
        self._thread = threading.Thread(target=self._write_loop, name="localllm-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        self._prefault_restorable()

    def _prefault_restorable(self) -> None:
        """Make as many of the pool's first blocks resident as this model has files, before the first
        request: a fresh process's restores fill the pool's first free blocks, and faulting their pages
        in then (one madvise per layer and chunk) was about a third of restoring a 4,096-token prompt
        here. Never more than the pool; the memory is what those restores would take anyway."""
        prefix = self._dir + os.sep
        with self.budget.lock:
            n = sum(1 for path in self.budget.files if path.startswith(prefix) and path.endswith(SUFFIX))
        self.kv.prefault_first(min(n, self.kv.num_blocks))

    def path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._dir, name[:2], name + SUFFIX)

    def load(self, key: bytes, token_ids: Sequence[int], block_id: int) -> bool:
        """Copy the block's file into the pool's block `block_id`; False (the block untouched) when
        there is no file or it fails a check (then it is deleted)."""
        path = self.path(key)
        try:
            k, v, mtime = self.reader.read(path, key, token_ids)
        except FileNotFoundError:
            return False
        except (BadBlockFile, OSError, ValueError) as e:
            self._discard(path, e)
            return False
        self.kv.write_block(block_id, k, v)
        self.budget.touch(path, mtime)
        self._known.add(key)
        self.stats.hits += 1
        return True

    def store(self, key: bytes, token_ids: Sequence[int], block_id: int) -> None:
        """Queue the pool's block `block_id` (just computed, keyed `key`) to be written, unless a file
        has it already or the queue is full (then it is dropped: the step never waits for the disk)."""
        if key in self._known:
            return
        k, v = self.kv.read_block(block_id)
        try:
            self._queue.put_nowait((key, tuple(token_ids), k, v))
        except queue.Full:
            self.stats.dropped += 1
            return
        self._known.add(key)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block is written (tests, shutdown); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer. Idempotent."""
        if self._thread.is_alive():
            self.flush(timeout)
            self._queue.put(None)
            self._thread.join(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # a full disk or a permissions problem: the block stays in RAM only
                self._known.discard(item[0])
                self._warn(f"could not write a block: {e}")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, token_ids: tuple[int, ...], k: np.ndarray, v: np.ndarray) -> None:
        path = self.path(key)  # written even where a file exists: it may be a damaged one, never read
        parts = encode(self.fingerprint, key, token_ids, k, v)
        size = sum(len(part) for part in parts)
        if not self.budget.reserve(size):
            self._known.discard(key)
            self.stats.dropped += 1
            return
        folder, name = os.path.split(path)
        temp = os.path.join(folder, f".{name}.{os.getpid()}-{threading.get_native_id()}{TEMP_SUFFIX}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(temp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(temp, path)  # atomic: readers see the whole file or none
        except BaseException:
            _unlink(temp)
            self.budget.release(size)
            raise
        self.budget.added(path, size)
        self.stats.writes += 1

    def _evicted(self, path: str) -> None:
        name = os.path.basename(path)
        if name.endswith(SUFFIX):
            try:
                self._known.discard(bytes.fromhex(name[: -len(SUFFIX)]))
            except ValueError:
                pass

    def _discard(self, path: str, reason: BaseException) -> None:
        """A file that failed a check: deleted (it is recomputed, and written again)."""
        _unlink(path)
        self.budget.forget(path)
        self._evicted(path)
        self.stats.bad += 1
        self._warn(f"{os.path.basename(path)}: {reason}; deleted, the block is recomputed")

    def _warn(self, message: str) -> None:
        """The first few problems as warnings, the rest at debug level (a damaged directory may hold
        thousands of bad files)."""
        self._warned += 1
        log.log(logging.WARNING if self._warned <= 5 else logging.DEBUG, "KV disk cache: %s", message)


def _walk(root: str) -> list[str]:
    """Every file's path under root."""
    return [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _block_shape(kv: KVCache) -> BlockShape:
    k, v = kv.read_block(0)
    return BlockShape(k.shape, v.shape, k.dtype, v.dtype)
