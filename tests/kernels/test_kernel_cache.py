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
    subprocess.run([sys.executable, str(CHILD), str(out)], env=env, check=True, timeout=600)
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
