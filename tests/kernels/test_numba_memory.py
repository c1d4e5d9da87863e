"""Kernels from Numba's cache without their parsed bitcode kept (kernels/lazy_bitcode.py), and Numba's
runtime library loaded from the cache instead of compiled (kernels/nrt_cache.py): a second process
takes both from the cache, and a function compiled afterwards still links against them and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paths import SUPPORT

CHILD = SUPPORT / "numba_memory_child.py"
FUNCS = """
import numpy as np
from numba import njit


@njit(cache=True)
def total(n):
    return np.arange(n).sum()  # allocates: goes through the runtime library
"""


def _child(tmp_path: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    run = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_cached_kernels_and_runtime_load_and_link_later_compiles(tmp_path: Path) -> None:
    (tmp_path / "cached_funcs.py").write_text(FUNCS)
    first = _child(tmp_path)
    assert not first["nrt_from_cache"] and not first["callee_from_cache"]
    assert list((tmp_path / "numba").glob("localllm-nrt-*.pkl")), "the runtime library was not saved"
    second = _child(tmp_path)
    assert second["nrt_from_cache"] and second["callee_from_cache"]
    assert not second["callee_module_kept"]  # its bitcode stays bytes until something links it
    assert first["symbols_recorded"] and second["symbols_recorded"]
    assert first["total"] == second["total"] == 45
    assert first["caller"] == second["caller"] == 55.0
