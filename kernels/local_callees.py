"""Each compiled kernel runs its own copies of the functions it calls, whichever kernels loaded first.

Numba links a copy of every callee's module into each caller's and optimises it again there. The copies
are `linkonce_odr`: weak symbols once in machine code, so the JIT resolves every call of a function that
was not inlined to the first copy of that name it loaded, and the others never run. With fastmath's
reassociation the copies need not round alike, so a process ran whichever copy its load order gave it: a
fresh process (copies in compile order) and one loading the same kernels from the cache (in load order)
computed different attention sums on Qwen2.5-1.5B (docs/architecture.md, cached kernels). Renamed with a
mark of the caller once its module is optimised, a caller's copies are its own: the machine code a kernel
runs is what its compilation produced, fresh or cached. The module a kernel offers its own callers for
linking names them as before, so a function reached along several paths still links in once, and the
optimiser inlines and drops them as before. (Made internal instead, or renamed in what callers link,
every path brought its own copy to optimise, and a first compile took longer.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import llvmlite.binding as ll
from numba.core import codegen

_Library = codegen.CPUCodeLibrary
_numba_optimize_final_module = _Library._optimize_final_module
_module_for_linking = _Library._get_module_for_linking  # (lazy_bitcode's, once that is installed)
MARK = "$own."  # name of a callee's copy = its name + MARK + its caller's mark


def caller_mark(module: Any) -> str:
    """A short hash of the names the module defines for others (its kernels' entry points): the same
    for a kernel however often it compiles, different between kernels."""
    names = sorted(
        fn.name for fn in module.functions if not fn.is_declaration and fn.linkage == ll.Linkage.external
    )
    return hashlib.sha256("\0".join(names).encode()).hexdigest()[:12]


def rename_linked(module: Any) -> int:
    """The module's linked-in (`linkonce_odr`) definitions renamed to its own; returns how many."""
    mark, count = MARK + caller_mark(module), 0
    for fn in module.functions:
        if not fn.is_declaration and fn.linkage == ll.Linkage.linkonce_odr:
            fn.name += mark
            count += 1
    return count


def unmark(module: Any) -> None:
    """The copies' original names back (in the module callers link): the same function linked in along
    two paths then merges into one, as in Numba without the marks."""
    for fn in module.functions:
        if MARK in fn.name:
            fn.name = fn.name.split(MARK)[0]


def _optimize_final_module(self: Any) -> None:
    _numba_optimize_final_module(self)
    # After optimising, before machine code: the passes see Numba's names (its reference-count pruning
    # finds NRT_incref/NRT_decref by name), the code they make is what it was, only its names change.
    rename_linked(self._final_module)


def _get_module_for_linking(self: Any) -> Any:
    module = _module_for_linking(self)
    if module is self._final_module:  # Numba hands out the module itself when it exports nothing
        module = self._shared_module = module.clone()
    unmark(module)
    return module


def keep_callees_local() -> None:
    """Install on Numba's CPU code libraries (idempotent); after lazy_bitcode, before any kernel compiles."""
    global _module_for_linking
    if _Library._optimize_final_module is not _optimize_final_module:
        _module_for_linking = _Library._get_module_for_linking
    _Library._optimize_final_module = _optimize_final_module  # type: ignore[method-assign]
    _Library._get_module_for_linking = _get_module_for_linking  # type: ignore[method-assign]
