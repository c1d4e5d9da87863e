"""Kernels loaded from Numba's cache keep their linking bitcode as bytes, parsed only when needed.

Numba loads a cached kernel as its machine code plus its LLVM bitcode, which it parses at once into a
module and keeps for any later compile that links the kernel in (a caller compiled afterwards). A
parsed module takes several times its bitcode's size, and a cached `run` links none of them
afterwards. Here the bitcode is parsed once to learn the symbols it defines (what Numba records from
it), dropped (its memory handed back to the system), and parsed again only if a later compile asks for
it (`_get_module_for_linking`). The machine code that runs is the same.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import llvmlite.binding as ll
from numba.core import codegen

_Library = codegen.CPUCodeLibrary
_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
_numba_unserialize = _Library._unserialize.__func__  # type: ignore[attr-defined]
_numba_module_for_linking = _Library._get_module_for_linking


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
    self._lazy_bitcode = shared_bitcode
    _release_free_heap()
    return self


def _load_defined_symbols(engine: Any, bitcode: bytes) -> None:
    """What Numba records of a module's definitions, read from a module parsed in a context of its own
    and disposed with it: parsed in the global context, its types, constants and metadata would stay
    there for the process's life (~25 MiB for the fused hybrid stack's bitcode)."""
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


def _get_module_for_linking(self: Any) -> Any:
    bitcode = getattr(self, "_lazy_bitcode", None)
    if bitcode is None or self._shared_module is not None:
        return _numba_module_for_linking(self)
    return ll.parse_bitcode(bitcode)  # not kept: a caller links it into its own module


def keep_bitcode_unparsed() -> None:
    """Install on Numba's CPU code libraries (idempotent); before kernels load from the cache."""
    _Library._unserialize = classmethod(_unserialize)  # type: ignore[method-assign,assignment]
    _Library._get_module_for_linking = _get_module_for_linking  # type: ignore[method-assign]
