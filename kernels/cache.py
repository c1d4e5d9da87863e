"""Numba's on-disk cache for these kernels, keyed by their source content instead of their path.

Numba files a cached function under a hash of its source folder's path and checks it against its own
source file only.  Reinstalling the same sources elsewhere (`pip install .`, then `pip install -e .`)
therefore compiled every kernel again, and an edit to a helper that another file inlines went unnoticed.
Under NUMBA_CACHE_DIR this package's kernels instead go in one folder named by a hash of all of its
sources, which is also every entry's freshness stamp: the same sources reuse the same machine code from
any path, and any change to any kernel file starts afresh.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from numba.core import caching, config

PACKAGE_DIR = Path(__file__).resolve().parent
# Numba >= 0.64 dropped the leading underscores of these names.
_BASE = getattr(caching, "UserProvidedCacheLocator", None) or caching._UserProvidedCacheLocator
_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl


def current_digest() -> str:
    """A hash of every kernel source file as it is on disk now, names included (~0.3 MB read)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """current_digest() as this process first read it: the cache folder's name."""
    return current_digest()


class SourceStamp(str):
    """The entries' freshness stamp: equal to sources_digest(), but written into an index (at each save)
    as the digest the files have then. A kernel file edited while a process imported the kernels left
    that process with old and new code, compiled together; its entries, saved in the old digest's
    folder, then carry the new digest, which no process reading that folder expects: never loaded."""

    def __reduce__(self):
        return (str, (current_digest(),))


class ContentKeyedLocator(_BASE):
    """The cache locator of functions defined in this package (others fall through to numba's own)."""

    def __init__(self, py_func, py_file) -> None:
        super().__init__(py_func, py_file)
        self._cache_path = os.path.join(config.CACHE_DIR, f"localllm-kernels-{sources_digest()}")

    def get_source_stamp(self) -> str:
        return SourceStamp(sources_digest())

    @classmethod
    def from_function(cls, py_func, py_file):
        if not config.CACHE_DIR or Path(py_file).resolve().parent != PACKAGE_DIR:
            return None
        return super().from_function(py_func, py_file)


def use_content_keyed_cache() -> None:
    """Put ContentKeyedLocator first; must run before any kernel module is imported (decorated)."""
    if ContentKeyedLocator not in _IMPL._locator_classes:
        _IMPL._locator_classes.insert(0, ContentKeyedLocator)
