"""Which tiles of a logits row the precise output projection refines (matmul.launch_refined).

One 8-bit pass gives every logit; the rounding residual's pass then runs only over the 64-row tiles that
hold the row's highest logits, where the probability is: those within REFINE_MARGIN of the row's
highest (a token that far below carries under e^-16 of the top one's probability at temperature 1),
the margin halved until at most max(REFINE_MIN_TILES, tiles / REFINE_SHARE) tiles qualify.  The choice
depends on the row's own one-pass logits only, so a row's result never depends on its batch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .packing import TILE_ROWS as R

REFINE_MARGIN = 16.0
REFINE_MIN_TILES = 4
REFINE_SHARE = 32  # at most 1/32 of the tiles (~3% more weight bytes read)
_HALVINGS = 12  # then the margin is 16/4096: rows this flat are refined however many tiles it takes


@njit(cache=True, nogil=True, fastmath=True)
def tile_maxima(row):
    """The highest value of each R-row tile of row (a maximum's value does not depend on the order
    taken: fastmath lets LLVM vectorise it; where a tile holds a NaN the result is unspecified)."""
    n = row.shape[0]
    out = np.empty((n + R - 1) // R, np.float32)
    for t in range(out.shape[0]):
        m = np.float32(-np.inf)
        for i in range(t * R, min(n, t * R + R)):
            m = row[i] if row[i] > m else m
        out[t] = m
    return out


@njit(cache=True, nogil=True)
def mark_tiles(row, mark) -> None:
    """mark[t] = True for the tiles of row that the residual pass refines (see the module's doc); none
    where the row's highest logit is infinite (a residual cannot move it) or -inf everywhere."""
    peaks = tile_maxima(row)
    top = peaks.max()
    if not np.isfinite(top):
        mark[:] = False
        return
    cap = max(REFINE_MIN_TILES, peaks.shape[0] // REFINE_SHARE)
    margin = np.float32(REFINE_MARGIN)
    for _ in range(_HALVINGS + 1):
        count = 0
        for t in range(peaks.shape[0]):
            mark[t] = peaks[t] >= top - margin
            count += mark[t]
        if count <= cap:
            return
        margin *= np.float32(0.5)
