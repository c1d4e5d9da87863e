"""The precise output projection's refinement (kernels/refine.py, matmul.launch_refined: linear_precise's
form for every integer-path kind but Q8_0): one 8-bit pass everywhere, the rounding residual's pass over
the tiles of each row's highest outputs, chosen from the row's own one-pass values (a NumPy twin of the
choice here), so no row depends on its batch."""

from __future__ import annotations

import numpy as np
import pytest
from random_weights import random_weight

from localllm.backends.numba_cpu import NumbaBackend
from localllm.kernels import matmul
from localllm.kernels import reference as ref
from localllm.kernels.packing import TILE_ROWS
from localllm.kernels.quantize_act import with_residual
from localllm.kernels.refine import REFINE_MARGIN, REFINE_MIN_TILES, REFINE_SHARE, mark_tiles

GGML = {"Q4_1": 3, "Q4_K": 12, "Q6_K": 14}


def numpy_marks(row: np.ndarray) -> np.ndarray:
    """The tiles mark_tiles picks, as NumPy computes them."""
    pad = -np.inf * np.ones(-len(row) % TILE_ROWS, np.float32)
    peaks = np.concatenate([row, pad]).reshape(-1, TILE_ROWS).max(axis=1)
    top = peaks.max()
    if not np.isfinite(top):
        return np.zeros(len(peaks), bool)
    cap, margin = max(REFINE_MIN_TILES, len(peaks) // REFINE_SHARE), np.float32(REFINE_MARGIN)
    for _ in range(13):
        mark = peaks >= top - margin
        if mark.sum() <= cap:
            break
        margin *= np.float32(0.5)
    return mark


@pytest.mark.parametrize("scale", [0.05, 1.0, 30.0])
def test_marked_tiles_equal_numpy(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 100))
    for n in (64, 100, 64 * 40 + 7, 64 * 300):
        row = (rng.standard_normal(n) * scale).astype(np.float32)
        mark = np.zeros((n + TILE_ROWS - 1) // TILE_ROWS, np.bool_)
        mark_tiles(row, mark)
        np.testing.assert_array_equal(mark, numpy_marks(row))
        assert mark[row.argmax() // TILE_ROWS]  # the highest output is always refined


def test_rows_without_a_finite_top_refine_nothing() -> None:
    """(A NaN's tiles are left unspecified: the maxima are vectorised under fastmath.)"""
    mark = np.ones(3, np.bool_)
    row = np.zeros(3 * TILE_ROWS, np.float32)
    row[5] = np.inf
    mark_tiles(row, mark)
    assert not mark.any()
    mark_tiles(np.full(3 * TILE_ROWS, -np.inf, np.float32), mark)
    assert not mark.any()


def refined(x: np.ndarray, w: matmul.PackedWeight, nth: int) -> np.ndarray:
    """linear_precise's form for the integer-path kinds other than Q8_0."""
    rounding = int(matmul.precise_rounding(matmul.rounding_of(w.kind)))
    return matmul.launch_refined(w.kernels[0], rounding, w.addr, w.nbytes, w.n, w.k, x, nth)


def one_pass(x: np.ndarray, w: matmul.PackedWeight) -> np.ndarray:
    """One 8-bit pass in the precise form's rounding (Q4_1 / Q5_1: exact sums, not Q8_1's)."""
    y = np.empty((x.shape[0], w.n), np.float32)
    rounding = int(matmul.precise_rounding(matmul.rounding_of(w.kind)))
    matmul.launch_linear_serial(w.kernels[0], 0, rounding, w.addr, w.nbytes, w.n, w.k, x, y)
    return y


@pytest.mark.parametrize("name", list(GGML))
def test_refined_tiles_are_the_two_pass_sum_and_the_rest_one_pass(name: str) -> None:
    """The marked tiles hold exactly what the two 8-bit passes gave everywhere before (within 1e-4 of
    float activations), the others exactly one pass; each row alone gives the same bits as in a batch."""
    rng = np.random.default_rng(len(name))
    n, k, T = TILE_ROWS * 160 + 3, 256, 4
    raw = random_weight(rng, name, n, k)
    backend = NumbaBackend(2)
    w = backend.prepare_weight(raw, GGML[name])
    x = rng.standard_normal((T, k)).astype(np.float32) * 4
    x2 = np.empty((2 * T, k), np.float32)
    with_residual(x, x2, int(matmul.precise_rounding(matmul.rounding_of(w.kind))))
    one = one_pass(x, w)
    two = one + one_pass(np.ascontiguousarray(x2[T:]), w)
    exact = ref.linear(x, raw, GGML[name])
    for nth in (1, 2):
        got = refined(x, w, nth)
        for t in range(T):
            rows = np.repeat(numpy_marks(one[t]), TILE_ROWS)[:n]
            assert 0 < rows.sum() < n
            np.testing.assert_array_equal(got[t, rows], two[t, rows])
            np.testing.assert_array_equal(got[t, ~rows], one[t, ~rows])
            err = np.abs(got[t, rows] - exact[t, rows]).max() / np.abs(exact[t]).max()
            assert err < 1e-4
            np.testing.assert_array_equal(refined(x[t : t + 1], w, nth)[0], got[t])
