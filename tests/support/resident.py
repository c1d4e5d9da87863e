"""Resident memory of one array's mappings, read from Linux's /proc/self/smaps."""

from __future__ import annotations

import numpy as np


def resident_kib(a: np.ndarray) -> int:
    """Rss of the mappings that overlap array a's bytes (madvise may split one mapping in several)."""
    lo_a = a.__array_interface__["data"][0]
    hi_a, rss, inside = lo_a + a.nbytes, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < hi_a and lo_a < hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1])
    return rss
