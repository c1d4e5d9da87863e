"""superblock.k_step (the K kinds' float step per 256 elements) against its scalar twin and NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from localllm.kernels import superblock as sb
from localllm.kernels.packing import TILE_ROWS as R


@njit
def _run(mode, s32, s16, sm, f0, dx, sx, acc):
    """The intrinsic for one superblock: mode 0 int32 sums, 2 int16 pairs, 3 pairs + fifth-bit sums."""
    m, d, x, s, a = sm.ctypes.data, f0.ctypes.data, dx.ctypes.data, sx.ctypes.data, acc.ctypes.data
    lo, hi, h = s16[0].ctypes.data, s16[1].ctypes.data, s16[2].ctypes.data
    if mode == 0:
        sb.k_step_sums(s32.ctypes.data, 0, 0, 4 * R, m, d, x, s, a)
    elif mode == 2:
        sb.k_step_pairs(lo, hi, h, 2 * R, m, d, x, s, a)
    else:
        sb.k_step_five(lo, hi, h, 2 * R, m, d, x, s, a)


def _case(seed: int, five: bool):
    rng = np.random.default_rng(seed)
    s16 = rng.integers(-30480, 30481, (3, 8, R)).astype(np.int16)
    s16[2] = rng.integers(-2032, 2033, (8, R)) if five else 0
    s32 = s16[0].astype(np.int32) + s16[1] + 16 * s16[2].astype(np.int32)
    sm = rng.integers(0, 64, (8, 2, R)).astype(np.uint8)
    f0 = np.float16(rng.uniform(1e-4, 0.05, (2, R))).view(np.uint16)
    f0[:, :3] = np.float16([0.0, 6e-8, 3e-5]).view(np.uint16)  # zero and fp16 subnormals
    dx = rng.uniform(1e-3, 0.1, 8).astype(np.float32)
    sx = (dx * rng.integers(-4000, 4000, 8)).astype(np.float32)
    acc = rng.normal(size=R).astype(np.float32)
    return s32, s16, sm, f0, dx, sx, acc


@pytest.mark.parametrize("mode", [0, 2, 3])
def test_k_step_equals_its_scalar_twin_and_numpy(mode: int) -> None:
    s32, s16, sm, f0, dx, sx, acc = _case(mode, five=mode == 3)
    simd, twin = acc.copy(), acc.copy()
    _run(mode, s32, s16, sm, f0, dx, sx, simd)
    sb.k_step_portable(s32, sm, f0, dx, sx, twin)
    np.testing.assert_array_equal(simd, twin)  # the same exact operations per lane
    d, dmin = f0.view(np.float16).astype(np.float64)
    t = (sm[:, 0].astype(np.float64) * s32 * dx[:, None]).sum(0)
    u = (sm[:, 1].astype(np.float64) * sx[:, None]).sum(0)
    exact = acc + d * t - dmin * u
    np.testing.assert_allclose(simd, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())
