"""Resident memory of one array's own pages, asked of Linux with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident_kib(a: np.ndarray) -> int:
    """KiB of the pages under array a's bytes that are resident. Exact to the array's own range:
    /proc/self/smaps counts whole mappings, and adjacent anonymous mappings merge with the array's
    (a neighbour's pages were counted as the array's)."""
    page = mmap.PAGESIZE
    start = a.__array_interface__["data"][0]
    lo, hi = start // page * page, -(-(start + a.nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    if _libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * page // 1024
