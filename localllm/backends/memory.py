"""Zeroed arrays that cost memory only where they are written: the KV pool.

np.zeros of a large array maps fresh zero pages, so untouched memory is not resident; but NumPy also
asks Linux for transparent huge pages on every allocation of 4 MiB or more, and then the first write
anywhere in a 2 MiB stretch makes all of it resident. The KV pool is laid out (layer, block, ...), so
one short request writes a block in every layer's stretch and the whole 8,192-token pool became
resident (SmolLM2: 176 MiB for a 90-token request). These arrays are mapped without huge pages: a
request costs the 4 KiB pages its blocks hold.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+ (Python 3.11 lacks the name)


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A writable zeroed array whose pages become resident only when written (no huge pages)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if nbytes == 0 or flags is None:  # (Windows: np.zeros, committed lazily by the OS anyway)
        return np.zeros(shape, dt)
    buf = mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux: also where THP is "always", not only "madvise"
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dt).reshape(shape)  # the array keeps the mapping alive


def populate(a: np.ndarray, start: int, length: int) -> bool:
    """Make bytes [start, start + length) of a lazy_zeros array resident in one call (madvise
    MADV_POPULATE_WRITE: no fault per page); False where the array or the kernel cannot."""
    buf = a.base
    while isinstance(buf, np.ndarray):
        buf = buf.base
    buf = buf.obj if isinstance(buf, memoryview) else buf
    if not isinstance(buf, mmap.mmap) or not hasattr(buf, "madvise") or length <= 0:
        return False
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = min(len(buf), -(-(start + length) // page) * page)
    try:
        buf.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
    except (OSError, ValueError):  # an older kernel: the pages fault in as they are written
        return False
    return True
