"""Kernels loaded from Numba's on-disk cache compute the same bits as freshly compiled ones.

Numba links a copy of every callee into each caller and optimises it again there, and a process
runs whichever copy of a symbol it loaded first: a fresh compile runs the callees' own code, a cache
load the caller's copies.  Float code compiled with reassociation rounded differently in the two
(the VNNI int matmul's scale step did, by ~2e-7: enough to flip a token of SmolLM2's reference case
from the cache only).  Two child processes, one into an empty NUMBA_CACHE_DIR and one from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from paths import SUPPORT

CHILD = SUPPORT / "kernel_cache_child.py"


def run_child(cache: Path, out: Path) -> dict[str, np.ndarray]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, str(CHILD), str(out), str(out.parent)], env=env, check=True, timeout=900)
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


def test_cached_kernels_equal_fresh_ones(tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    cache.mkdir()
    fresh = run_child(cache, tmp_path / "fresh.npz")
    assert any(cache.rglob("*.nbi")), "the first run wrote no cache"
    cached = run_child(cache, tmp_path / "cached.npz")
    assert fresh.keys() == cached.keys()
    differ = [k for k in fresh if not np.array_equal(fresh[k], cached[k])]
    assert not differ, f"cached kernels differ from fresh ones: {differ}"


def _index(folder: Path, stamp: str):
    from numba.core.caching import IndexDataCacheFile

    return IndexDataCacheFile(cache_path=str(folder), filename_base="f-1.py", source_stamp=stamp)


def test_entries_saved_after_a_kernel_file_changed_are_never_loaded(tmp_path: Path, monkeypatch) -> None:
    """A process that imported the kernels while a file changed holds old and new code: what it saves
    must not pass for the digest its folder is named by (the next process reading it segfaulted)."""
    from localllm.kernels import cache

    stamp = cache.ContentKeyedLocator.get_source_stamp(None)
    assert stamp == cache.sources_digest() == cache.current_digest()
    _index(tmp_path, stamp).save("sig", b"code")
    assert _index(tmp_path, cache.SourceStamp(cache.sources_digest())).load("sig") == b"code"

    monkeypatch.setattr(cache, "current_digest", lambda: "edited-meanwhile")
    _index(tmp_path, stamp).save("sig2", b"mixed code")
    monkeypatch.undo()
    fresh = _index(tmp_path, cache.SourceStamp(cache.sources_digest()))
    assert fresh.load("sig") is None and fresh.load("sig2") is None
