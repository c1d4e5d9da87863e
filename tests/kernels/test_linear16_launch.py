"""linear_precise's Q8_0 launchers (int16 activations): the serial one (one thread, or little work) and
the parallel one (tiles shared out in pieces) give the same bits, whatever Numba's team size on the
calling thread, and both match the NumPy twin's product with the same rounded activations."""

from __future__ import annotations

import threading

import gguf
import numpy as np
from random_weights import random_weight

from localllm.kernels import matmul
from localllm.kernels import reference as ref
from localllm.kernels.packing import TILE_ROWS
from localllm.kernels.quantize_act import quantize_rows16

ROWS = 5 * TILE_ROWS + 7  # a partial last tile, and enough work for the parallel launcher
COLS = 512


def _weight_and_rows(seed: int, t: int) -> tuple[np.ndarray, matmul.PackedWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, "Q8_0", ROWS, COLS)
    w = matmul.prepare_weight(raw, gguf.GGMLQuantizationType.Q8_0)
    return raw, w, rng.standard_normal((t, COLS)).astype(np.float32)


def test_serial_and_parallel_launches_agree_bit_for_bit() -> None:
    _, w, x = _weight_and_rows(16, 3)
    assert w.nbytes * x.shape[0] >= matmul.PARALLEL_MIN_WORK  # nth=2 takes the parallel launcher
    serial = matmul.linear_precise(x, w, 1)
    np.testing.assert_array_equal(matmul.linear_precise(x, w, 2), serial)
    for t in range(x.shape[0]):  # and a lone row gives its batch's bits
        np.testing.assert_array_equal(matmul.linear_precise(x[t : t + 1], w, 2)[0], serial[t])


def test_one_thread_from_a_thread_with_a_wider_team() -> None:
    """A thread other than the one that set the team size (an engine's loop) has Numba's default team:
    the one-thread launch must give the same bits there."""
    _, w, x = _weight_and_rows(17, 1)
    expected = matmul.linear_precise(x, w, 1)
    got: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: got.append(matmul.linear_precise(x, w, 1)))
    worker.start()
    worker.join()
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], expected)


def test_matches_the_numpy_twin_with_the_same_int16_activations() -> None:
    raw, w, x = _weight_and_rows(18, 2)
    x16, dx = quantize_rows16(x)
    x_rounded = (x16.astype(np.float32).reshape(2, -1, 32) * dx[:, :, None]).reshape(2, COLS)
    expected = ref.linear(x_rounded, raw, gguf.GGMLQuantizationType.Q8_0)
    for nth in (1, 2):
        got = matmul.linear_precise(x, w, nth)
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
