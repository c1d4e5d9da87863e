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
