"""Numba's runtime (NRT) library loaded from NUMBA_CACHE_DIR instead of compiled in every process.

Before its first kernel, each process compiles NRT's few atomic helpers through LLVM's whole
optimisation and code-generation pipeline; that is the only compile a cached `run` does, and it maps
much more of libllvmlite's code into memory than loading cached kernels needs. Here the compiled
library is saved once, keyed like Numba's own cache entries (Numba and llvmlite versions, target
triple, CPU name and features), and loaded as machine code plus bitcode like any cached kernel.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import llvmlite
import numba
from numba.core import config
from numba.core.runtime import nrtdynmod

_numba_compile = nrtdynmod.compile_nrt_functions


class _PlainUnpickler(pickle.Unpickler):
    """The saved state is strings, tuples and bytes: a file naming any global is not ours."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} in the NRT cache file")


def _cache_file(ctx: Any) -> Path | None:
    if not config.CACHE_DIR:
        return None
    key = repr((numba.__version__, llvmlite.__version__, ctx.codegen().magic_tuple()))
    return Path(config.CACHE_DIR) / f"localllm-nrt-{hashlib.sha256(key.encode()).hexdigest()[:20]}.pkl"


def _compile_and_save(ctx: Any, path: Path | None) -> Any:
    ir_mod, library = nrtdynmod.create_nrt_module(ctx)
    library.enable_object_caching()  # keeps the machine code, to save it
    library.add_ir_module(ir_mod)
    library.finalize()
    if path is not None:
        try:
            state = library.serialize_using_object_code()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(tmp, path)
        except (OSError, RuntimeError, ValueError):
            pass  # a cache we cannot write costs the compile next time, nothing else
    return library


def compile_nrt_functions(ctx: Any) -> Any:
    """nrtdynmod.compile_nrt_functions, from the cache when it holds this machine's library."""
    path = _cache_file(ctx)
    if path is not None and path.is_file():
        try:
            state = _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
            if state[0] == "nrt" and state[1] == "object":
                return ctx.codegen().unserialize_library(state)
        except Exception:  # a damaged or foreign file: compile afresh (and overwrite it)
            pass
    return _compile_and_save(ctx, path)


def load_nrt_from_cache() -> None:
    """Install before Numba's runtime initialises (its first compile or cache load)."""
    nrtdynmod.compile_nrt_functions = compile_nrt_functions
