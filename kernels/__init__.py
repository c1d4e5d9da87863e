"""Numba CPU kernels computing directly on quantized GGUF blocks, and their NumPy twins.

`reference` is the NumPy oracle; `matmul`, `attention`, `layers` hold the Numba kernels (compiled on
first use, then loaded from NUMBA_CACHE_DIR), and `localllm.backends.numba_cpu.NumbaBackend` puts them
behind the Backend protocol.
"""

import os as _os
import sys as _sys
from pathlib import Path as _Path


def default_cache_dir(home: _Path | None = None) -> str:
    """Where compiled kernels go unless NUMBA_CACHE_DIR says otherwise: HOME/numba_cache/<a hash of
    these sources>, HOME being $LOCALLLM_HOME or ~/.cache/localllm."""
    import hashlib

    home = home or _Path(_os.environ.get("LOCALLLM_HOME", "~/.cache/localllm")).expanduser()
    digest = hashlib.sha256()
    for source in sorted(_Path(__file__).resolve().parent.glob("*.py")):
        digest.update(source.read_bytes())
    return str(home / "numba_cache" / digest.hexdigest()[:16])


# Compiled kernels are found by their sources' content, from any install path (see cache.py), whoever
# imports them (the CLI, the Python API, a script building an LLMEngine): under Numba's own cache a
# kernel whose inlined helper changed in another file ran its old machine code.  This must run before
# any kernel module is decorated.
_os.environ.setdefault("NUMBA_CACHE_DIR", default_cache_dir())
if "numba" in _sys.modules:  # imported first: it read its configuration without ours
    from numba.core import config as _config

    _config.reload_config()

from .cache import use_content_keyed_cache  # noqa: E402
from .lazy_bitcode import keep_bitcode_unparsed  # noqa: E402
from .local_callees import keep_callees_local  # noqa: E402
from .nrt_cache import load_nrt_from_cache  # noqa: E402

use_content_keyed_cache()
keep_bitcode_unparsed()  # and two memory savers for kernels loaded from the cache
load_nrt_from_cache()
keep_callees_local()  # each kernel runs its own callees' copies, fresh or cached
