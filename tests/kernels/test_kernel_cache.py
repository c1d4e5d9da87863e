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


def test_linked_copies_are_renamed_to_their_callers() -> None:
    """local_callees: the linked-in (linkonce_odr) definitions take the caller's mark, its own functions
    and declarations keep their names, and the module offered for linking gets the names back."""
    import llvmlite.binding as ll

    from localllm.kernels.local_callees import MARK, caller_mark, rename_linked, unmark

    module = ll.parse_assembly(
        "define linkonce_odr i32 @copy(i32 %x) {\n  ret i32 %x\n}\n"
        "define i32 @own(i32 %x) {\n  %y = call i32 @copy(i32 %x)\n"
        "  %z = call i32 @ext(i32 %y)\n  ret i32 %z\n}\n"
        "declare i32 @ext(i32)\n"
    )
    mark = MARK + caller_mark(module)
    assert rename_linked(module) == 1
    names = {fn.name: fn.linkage for fn in module.functions}
    assert names == {
        "copy" + mark: ll.Linkage.linkonce_odr, "own": ll.Linkage.external, "ext": ll.Linkage.external
    }  # fmt: skip
    assert f'call i32 @"copy{mark}"' in str(module)  # the call follows the rename
    other = ll.parse_assembly("define i32 @other(i32 %x) {\n  ret i32 %x\n}\n")
    assert caller_mark(other) != caller_mark(module)
    unmark(module)
    assert sorted(fn.name for fn in module.functions) == ["copy", "ext", "own"]


def test_a_compiled_kernel_calls_only_its_own_copies() -> None:
    """With the hook installed (as under NUMBA_CACHE_DIR), every callee copy in a caller's machine code
    carries that caller's mark (no name another kernel's copy could answer to), and what a later
    caller links carries none (one copy per function there, as without the marks)."""
    import llvmlite.binding as ll
    from numba import njit

    from localllm.kernels.local_callees import MARK, caller_mark, keep_callees_local

    keep_callees_local()

    @njit(fastmath=True, no_cpython_wrapper=True)
    def total(a):
        s = 0.0
        for v in a:
            s += v
        return s

    @njit(fastmath=True)
    def caller(a):
        return total(a) + total(a[1:])

    @njit(fastmath=True)
    def outer(a):
        return caller(a) + total(a)

    a = np.arange(100, dtype=np.float64)
    assert outer(a) == 2 * a.sum() + a[1:].sum()
    for fn in (caller, outer):
        library = fn.overloads[fn.signatures[0]].library
        module = library._final_module
        copies = [
            f.name for f in module.functions if not f.is_declaration and f.linkage != ll.Linkage.external
        ]
        assert copies and all(name.endswith(MARK + caller_mark(module)) for name in copies), copies
        assert not [f.name for f in library._get_module_for_linking().functions if MARK in f.name]


def test_kernels_imported_anywhere_use_the_content_keyed_cache(tmp_path: Path) -> None:
    """Without NUMBA_CACHE_DIR, and with Numba imported first (a script building an LLMEngine), the
    kernels still go under LOCALLLM_HOME in the folder keyed by all their sources, not Numba's own
    per-file cache, which ran a kernel's old machine code after an inlined helper changed elsewhere."""
    code = (
        "import numba, localllm.kernels as k\n"
        "from numba.core import config\n"
        "from localllm.kernels import matmul\n"
        "from localllm.kernels.cache import ContentKeyedLocator\n"
        "loc = ContentKeyedLocator.from_function(matmul.launch_linear.py_func, matmul.__file__)\n"
        "print(config.CACHE_DIR == k.default_cache_dir(), loc is not None, loc.get_cache_path())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"LOCALLLM_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    same, found, path = out.stdout.split()
    assert same == found == "True"
    assert Path(path).is_relative_to(tmp_path / "numba_cache") and "localllm-kernels-" in path
