"""Kernels from Numba's cache without their bitcode kept, parsed or not (kernels/lazy_bitcode.py), and
Numba's runtime library loaded from the cache instead of compiled (kernels/nrt_cache.py): a second
process takes both from the cache, and a function compiled afterwards still links against them (the
kernel's bitcode read again from its cache file) and runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
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
    assert not second["callee_module_kept"] and not second["callee_bytes_kept"]  # read again to link
    assert first["symbols_recorded"] and second["symbols_recorded"]
    assert first["total"] == second["total"] == 45
    assert first["caller"] == second["caller"] == 55.0


def test_bitcode_read_again_only_from_the_entry_it_came_from(tmp_path: Path) -> None:
    from localllm.kernels.lazy_bitcode import bitcode_of

    entry = tmp_path / "kernel.nbc"
    entry.write_bytes(pickle.dumps(((("kernel", "object", (b"machine code", b"bitcode")), "fndesc"),)))
    same = SimpleNamespace(name="kernel", _bitcode_source=(entry, zlib.crc32(b"bitcode")))
    assert bitcode_of(same) == b"bitcode"
    changed = SimpleNamespace(name="kernel", _bitcode_source=(entry, zlib.crc32(b"other bitcode")))
    with pytest.raises(RuntimeError, match="changed while localllm ran"):
        bitcode_of(changed)
    gone = SimpleNamespace(name="kernel", _bitcode_source=(tmp_path / "gone.nbc", 0))
    with pytest.raises(RuntimeError, match="cannot be read again"):
        bitcode_of(gone)
    assert bitcode_of(SimpleNamespace(name="fresh")) is None  # compiled here: Numba keeps its module
