"""How a parallel matmul's tiles are cut into the pieces its threads take from a shared counter.

A launch over several weights (q/k/v, gate/up) is one range of tiles. It is cut into nth * m pieces of
nearly equal weight bytes: m pieces per thread (up to PIECES_PER_THREAD, so a thread that another process
holds off its core leaves its later pieces to the others), fewer where a piece would fall under
MIN_PIECE_WORK (each range-kernel call sets up its scratch). A whole number of pieces per thread, each
of equal bytes, keeps two threads even on small launches: a fixed piece size left q/k/v's 24 decode tiles
as pieces of 8, 8 and 8 (one thread ran two of them), and a decode step is bound by its weight bytes, not
its rows (a Q6_K tile is half again a Q4_K one).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .packing import TILE_ROWS as R

PIECES_PER_THREAD = 4
MIN_PIECE_WORK = 256  # 32-blocks x activation rows


@njit(cache=True)
def weight_tiles(table):
    """The first global tile of each weight of a launch table (rows: fn, address, bytes, n, k); [-1]: all."""
    tiles = np.zeros(table.shape[0] + 1, np.int64)
    for i in range(table.shape[0]):
        tiles[i + 1] = tiles[i] + (table[i, 3] + R - 1) // R
    return tiles


@njit(cache=True)
def piece_count(total_tiles, nth, tile_work):
    """nth * m pieces (at most one a tile): m up to PIECES_PER_THREAD while each holds MIN_PIECE_WORK;
    one piece for one thread (nothing to share, and each piece sets up its scratch again)."""
    if nth <= 1:
        return 1
    m = max(1, min(PIECES_PER_THREAD, total_tiles * tile_work // (nth * MIN_PIECE_WORK)))
    return max(1, min(total_tiles, nth * m))


@njit(cache=True)
def piece_bounds(table, tiles, pieces, out) -> None:
    """out[0..pieces]: the global tile where each piece starts (out[pieces] = total), cutting the weights'
    bytes into `pieces` nearly equal parts (a tile's bytes: its weight's bytes over its tiles)."""
    total_bytes = 0.0
    for i in range(table.shape[0]):
        total_bytes += table[i, 2]
    out[0] = 0
    p, before = 1, 0.0  # next boundary, bytes before the current tile
    for i in range(table.shape[0]):
        per_tile = table[i, 2] / max(1, tiles[i + 1] - tiles[i])
        for g in range(tiles[i], tiles[i + 1]):
            while p < pieces and before + 0.5 * per_tile >= total_bytes * p / pieces:
                out[p] = g  # the tile's middle lies past the boundary: it starts the next piece
                p += 1
            before += per_tile
    while p <= pieces:
        out[p] = tiles[-1]
        p += 1


@njit(cache=True)
def plan_pieces(table, nth, tile_work):
    """(first global tile of each weight, piece bounds) for a launch of `table` on nth threads."""
    tiles = weight_tiles(table)
    pieces = piece_count(tiles[-1], nth, tile_work)
    bounds = np.empty(pieces + 1, np.int64)
    piece_bounds(table, tiles, pieces, bounds)
    return tiles, bounds


@njit(cache=True)
def counter_pieces(total, nth, tile_work):
    """(tiles per piece, the shared counter of the next tile to take) for a launch over total tiles of
    tile_work blocks x rows each whose threads take equal-tile pieces from a counter (moe's launches,
    where a tile's cost is its expert's rows): PIECES_PER_THREAD a thread, none under MIN_PIECE_WORK."""
    piece = max(-(-total // (nth * PIECES_PER_THREAD)), -(-MIN_PIECE_WORK // max(1, tile_work)))
    return max(1, piece), np.zeros(1, np.int64)
