"""Kernels loaded from Numba's cache keep their linking bitcode on disk, parsed only when needed.

Numba loads a cached kernel as its machine code plus its LLVM bitcode, which it parses at once into a
module and keeps for any later compile that links the kernel in (a caller compiled afterwards). A
parsed module takes several times its bitcode's size, and a cached `run` links none of them
afterwards. Here the bitcode is parsed once, in an LLVM context of its own, to learn the symbols it
defines (what Numba records from it), and dropped with that context (its memory handed back to the
system). A kernel read from a cache file keeps only that file's path and the bitcode's checksum (the
bytes were ~4 MiB a model), and reads it again only if a later compile asks for it
(`_get_module_for_linking`); one loaded otherwise (Numba's runtime library, nrt_cache.py) keeps the
bytes. The machine code that runs is the same.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import llvmlite.binding as ll
from numba.core import caching, codegen

_Library = codegen.CPUCodeLibrary
_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
_numba_unserialize = _Library._unserialize.__func__  # type: ignore[attr-defined]
_numba_module_for_linking = _Library._get_module_for_linking
_numba_load_overload = caching.Cache.load_overload
_numba_load_data = caching.IndexDataCacheFile._load_data
_loading = threading.local()  # .path: the cache data file whose kernel this thread is rebuilding


def _unserialize(cls: type, cg: Any, state: tuple[str, str, Any]) -> Any:
    """Numba's object-code branch of CPUCodeLibrary._unserialize, keeping the bitcode unparsed."""
    name, kind, data = state
    if kind != "object":
        return _numba_unserialize(cls, cg, state)
    object_code, shared_bitcode = data
    self = cg.create_library(name)
    assert isinstance(self, cls)
    self.enable_object_caching()
    self._set_compiled_object(object_code)
    self._finalize_final_module()
    _load_defined_symbols(self._codegen._engine, shared_bitcode)
    path, _loading.path = getattr(_loading, "path", None), None  # one library per cache entry
    if path is None:
        self._lazy_bitcode = shared_bitcode
    else:
        self._bitcode_source = (path, zlib.crc32(shared_bitcode))
    _release_free_heap()
    return self


def _load_defined_symbols(engine: Any, bitcode: bytes) -> None:
    """What Numba records of a module's definitions, read from a module parsed in a context of its own
    and disposed with it: parsed in the global context, its types, constants and metadata would stay
    there for the process's life (~6 MiB for a hybrid model's kernels)."""
    context = ll.create_context()
    try:
        module = ll.parse_bitcode(bitcode, context)
        try:
            engine._load_defined_symbols(module)
        finally:
            module.close()
    finally:
        context.close()


def _release_free_heap() -> None:
    """Give the parsed module's freed memory back to the system (glibc keeps it otherwise, and the
    fused decoder stack's bitcode alone parses into megabytes). Elsewhere (macOS, musl) nothing to do."""
    if _TRIM is not None:
        _TRIM(0)


def bitcode_of(library: Any) -> bytes | None:
    """A kernel's linking bitcode: kept, or read again from its cache file (None: not loaded here)."""
    kept = getattr(library, "_lazy_bitcode", None)
    source = getattr(library, "_bitcode_source", None)
    if kept is not None or source is None:
        return kept
    path, crc = source
    try:
        with open(path, "rb") as f:
            entry = pickle.loads(f.read())  # as Numba read it (IndexDataCacheFile._load_data)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise RuntimeError(f"Numba's cache entry {path} cannot be read again ({e}): restart localllm") from e
    for name, _, (_, bitcode) in _library_states(entry):
        if name == library.name and zlib.crc32(bitcode) == crc:
            return bitcode
    raise RuntimeError(f"Numba's cache entry {path} changed while localllm ran: restart it")


def _library_states(obj: Any) -> Iterator[tuple[str, str, tuple[bytes, bytes]]]:
    """The serialized code libraries (name, "object", (object code, bitcode)) inside a cache entry."""
    if isinstance(obj, (tuple, list)):
        if len(obj) == 3 and obj[1] == "object" and isinstance(obj[0], str) and isinstance(obj[2], tuple):
            yield obj  # type: ignore[misc]
            return
        for item in obj:
            yield from _library_states(item)


def _get_module_for_linking(self: Any) -> Any:
    bitcode = bitcode_of(self)
    if bitcode is None or self._shared_module is not None:
        return _numba_module_for_linking(self)
    return ll.parse_bitcode(bitcode)  # not kept: a caller links it into its own module


def _load_overload(self: Any, sig: Any, target_context: Any) -> Any:
    try:
        return _numba_load_overload(self, sig, target_context)
    finally:
        _loading.path = None  # an entry that was not rebuilt names no later library


def _load_data(self: Any, name: str) -> Any:
    _loading.path = self._data_path(name)
    return _numba_load_data(self, name)


def keep_bitcode_unparsed() -> None:
    """Install on Numba's CPU code libraries and its cache (idempotent); before kernels load from it."""
    _Library._unserialize = classmethod(_unserialize)  # type: ignore[method-assign,assignment]
    _Library._get_module_for_linking = _get_module_for_linking  # type: ignore[method-assign]
    caching.Cache.load_overload = _load_overload  # type: ignore[method-assign]
    caching.IndexDataCacheFile._load_data = _load_data  # type: ignore[method-assign]
