"""Child process of test_numba_memory.py: run with NUMBA_CACHE_DIR set and a folder holding
`cached_funcs.py`; prints what came from the cache and the results, as JSON."""

from __future__ import annotations

import json
import sys

import numpy as np
from numba import njit
from numba.core.runtime import rtsys

import localllm.kernels  # noqa: F401  (installs the cache hooks before Numba's runtime starts)
from localllm.kernels.lazy_bitcode import bitcode_of

sys.path.insert(0, sys.argv[1])
import cached_funcs  # noqa: E402


@njit
def fresh_caller(n):  # never cached: compiled now, linking the cached callee and the runtime in
    return cached_funcs.total(n) + np.ones(n).sum()


def _symbols_recorded(library) -> bool:
    """Whether the JIT engine knows every symbol the library's bitcode defines (read, for a cached
    library, from a module parsed in a context of its own and disposed)."""
    import llvmlite.binding as ll

    bitcode = bitcode_of(library)
    module = ll.parse_bitcode(bitcode) if bitcode is not None else library._get_module_for_linking()
    defined = {f.name for f in module.functions if not f.is_declaration}
    return bool(defined) and defined <= library._codegen._engine._defined_symbols


def main() -> None:
    total = cached_funcs.total(10)
    library = cached_funcs.total.overloads[cached_funcs.total.signatures[0]].library
    out = {
        "total": int(total),
        "caller": float(fresh_caller(10)),
        "nrt_from_cache": hasattr(rtsys.library, "_lazy_bitcode"),  # its bytes kept (nrt_cache.py)
        "callee_from_cache": hasattr(library, "_bitcode_source"),  # its bitcode left in the cache file
        "callee_bytes_kept": hasattr(library, "_lazy_bitcode"),
        "callee_module_kept": library._shared_module is not None,
        "symbols_recorded": _symbols_recorded(library),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
