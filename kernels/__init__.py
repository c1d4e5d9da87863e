"""Numba CPU kernels computing directly on quantized GGUF blocks, and their NumPy twins.

`reference` is the NumPy oracle; `matmul`, `attention`, `layers` hold the Numba kernels (compiled on
first use, or loaded from NUMBA_CACHE_DIR), and `localllm.backends.numba_cpu.NumbaBackend` puts them
behind the Backend protocol.  Importing this package imports Numba only under NUMBA_CACHE_DIR.
"""

import os as _os

if _os.environ.get("NUMBA_CACHE_DIR"):
    # Compiled kernels are found by their sources' content, from any install path (see cache.py); this
    # must run before any kernel module is decorated.  The NumPy reference alone needs none of it.
    from .cache import use_content_keyed_cache
    from .lazy_bitcode import keep_bitcode_unparsed
    from .local_callees import keep_callees_local
    from .nrt_cache import load_nrt_from_cache

    use_content_keyed_cache()
    keep_bitcode_unparsed()  # and two memory savers for kernels loaded from the cache
    load_nrt_from_cache()
    keep_callees_local()  # each kernel runs its own callees' copies, fresh or cached
