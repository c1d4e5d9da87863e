"""MXFP4 Numba kernels against the NumPy oracle (kernels/reference.py on gguf-exact dequantization).

The integer path rounds activations to int8 per 32-block as llama.cpp does, so the product is checked
tightly (1e-5 of the output range) against the oracle fed the same rounded activations, and loosely
(2.5e-2) against float activations; the AVX2 IR sums equal the portable loops' bit for bit; the float
path and the embedding rows are exact dequantization.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from numba import njit
from random_weights import random_weight

from localllm.kernels import matmul
from localllm.kernels import matmul_mxfp4 as mx
from localllm.kernels import reference as ref
from localllm.kernels.packing import TILE_ROWS
from localllm.kernels.quantize_act import quantize_rows
from localllm.kernels.simd_x86 import HAVE_AVX2, PAIRS_BYTES
from localllm.quant import dequantize
from localllm.quant.ggml import e8m0_half

MXFP4 = 39
INT_TOL, INT_EXACT_TOL, FLOAT_TOL = 2.5e-2, 1e-5, 1e-5


def rel_err(ours: np.ndarray, expected: np.ndarray) -> float:
    assert ours.shape == expected.shape and ours.dtype == np.float32
    return float(np.abs(ours - expected).max() / max(np.abs(expected).max(), 1e-30))


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the integer path sees it: int8 per 32-block, back to float."""
    x8, dx, _ = ref.quantize_activations(x)
    return (x8.reshape(x.shape[0], -1, 32) * dx[..., None]).reshape(x.shape).astype(np.float32)


@pytest.mark.parametrize("n,k", [(70, 512), (33, 96), (128, 2880)])
@pytest.mark.parametrize("t", [1, 2, 17])
def test_linear_matches_oracle(n: int, k: int, t: int) -> None:
    rng = np.random.default_rng(zlib.crc32(f"mxfp4 {n} {k} {t}".encode()))
    raw = random_weight(rng, "MXFP4", n, k)
    w = matmul.prepare_weight(raw, MXFP4)
    x = rng.standard_normal((t, k)).astype(np.float32)
    y = matmul.linear(x, w, nth=2)
    assert rel_err(y, ref.linear(x, raw, MXFP4)) < INT_TOL
    assert rel_err(y, ref.linear(rounded(x), raw, MXFP4)) < INT_EXACT_TOL


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_extreme_activations_stay_finite(scale: float) -> None:
    rng = np.random.default_rng(7)
    raw = random_weight(rng, "MXFP4", 64, 256)
    w = matmul.prepare_weight(raw, MXFP4)
    x = (rng.standard_normal((3, 256)) * scale).astype(np.float32)
    y = matmul.linear(x, w, nth=1)
    assert np.isfinite(y).all()
    assert rel_err(y, ref.linear(x, raw, MXFP4)) < INT_TOL


def test_float_path_and_embedding_are_exact_dequantization() -> None:
    rng = np.random.default_rng(8)
    raw = random_weight(rng, "MXFP4", TILE_ROWS + 9, 160)
    w = matmul.prepare_weight(raw, MXFP4)
    ids = np.array([0, 3, TILE_ROWS, TILE_ROWS + 8])
    np.testing.assert_array_equal(matmul.embedding(w, ids), dequantize(raw[ids], MXFP4))
    x = rng.standard_normal((5, 160)).astype(np.float32)
    y = np.empty((5, w.n), np.float32)
    matmul.launch_linear_serial(w.kernels[1], w.gemm, matmul.ROUND_NONE, w.addr, w.nbytes, w.n, w.k, x, y)
    assert rel_err(y, ref.linear(x, raw, MXFP4)) < FLOAT_TOL


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Decode (one row, direct kernel) and a batch (looked-up pairs) give a row the same bits."""
    rng = np.random.default_rng(9)
    raw = random_weight(rng, "MXFP4", 3 * TILE_ROWS, 320)
    w = matmul.prepare_weight(raw, MXFP4)
    x = rng.standard_normal((6, 320)).astype(np.float32)
    batch = matmul.linear(x, w, nth=2)
    for i in range(6):
        np.testing.assert_array_equal(matmul.linear(x[i : i + 1], w, nth=1)[0], batch[i])


@njit(cache=True)
def _sums(q3, xr, s_direct, s_pairs, s_portable, pairs):
    q, x, p = q3.ctypes.data, xr.ctypes.data, pairs.ctypes.data
    for b in range(q3.shape[0]):
        if mx.HAVE_AVX2:
            sd, sp = s_direct[b].ctypes.data, s_pairs[b].ctypes.data
            mx.mxfp4_block_sums_avx2(q + b * 16 * TILE_ROWS, x + b * 32, sd, sd + 2 * TILE_ROWS)
            mx.mxfp4_unpack_pairs_avx2(q + b * 16 * TILE_ROWS, p)
            mx.mxfp4_pair_sums_avx2(p, x + b * 32, sp, sp + 2 * TILE_ROWS)
        mx.block_sums_portable(q3, b, xr, s_portable[b])


@pytest.mark.skipif(not HAVE_AVX2, reason="the IR kernels need AVX2")
def test_avx2_sums_equal_portable_ones() -> None:
    """Every code against activations at the int8 extremes: the largest sums (12 * 127 * 16) fit."""
    rng = np.random.default_rng(10)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    q3[0] = 0x77  # +12 everywhere
    q3[1] = 0xFF  # -12 everywhere
    xr = rng.integers(-127, 128, nb * 32).astype(np.int8)
    xr[:64] = 127
    sums = [np.zeros((nb, 2, TILE_ROWS), np.int16) for _ in range(3)]
    _sums(q3, xr, *sums, np.zeros(PAIRS_BYTES, np.uint8))
    np.testing.assert_array_equal(sums[0], sums[2])
    np.testing.assert_array_equal(sums[1], sums[2])
    assert int(sums[2][0, 0, 0]) + int(sums[2][0, 1, 0]) == 12 * 127 * 32


def test_quantized_activations_times_values_is_the_integer_sum() -> None:
    """The portable sum equals a NumPy dot of looked-up values and interleaved int8 activations."""
    rng = np.random.default_rng(11)
    q3 = rng.integers(0, 256, (2, 16, TILE_ROWS), dtype=np.uint8)
    x8, _, _, _, x8p = quantize_rows(rng.standard_normal((1, 64)).astype(np.float32), matmul.ROUND_Q8_0)
    s = np.zeros((2, TILE_ROWS), np.int16)
    mx.block_sums_portable(q3, 1, x8p[0], s)
    values = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
    w = np.concatenate([values[q3[1] & 15], values[q3[1] >> 4]], axis=0)  # (32, R) element order
    np.testing.assert_array_equal(s.astype(np.int32).sum(axis=0), x8[0, 32:64].astype(np.int32) @ w)


def test_e8m0_scale_matches_numpy_for_every_byte() -> None:
    e = np.arange(256, dtype=np.uint8)
    ours = np.array([mx.e8m0_half(np.uint8(v)) for v in e], np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), e8m0_half(e).view(np.uint32))


@njit(cache=True)
def _vnni_sums(q3, x8, s_vnni, s_quads, quads):
    q, x, p = q3.ctypes.data, x8.ctypes.data, quads.ctypes.data
    for b in range(q3.shape[0]):
        mx.mxfp4_block_sums_vnni(q + b * 16 * TILE_ROWS, x + b * 32, s_vnni[b].ctypes.data, 0)
        mx.mxfp4_unpack_quads_vnni(q + b * 16 * TILE_ROWS, p)
        mx.quad_sums_vnni(p, x + b * 32, s_quads[b].ctypes.data)


@pytest.mark.skipif(not mx.HAVE_VNNI, reason="the VNNI kernel needs AVX512-VNNI")
def test_vnni_sums_less_their_offset_equal_portable_ones() -> None:
    """One row's VNNI totals (values + 12, plain-order activations; in registers, and from the quads that
    more rows share) less 12 * the block's activation sum are the portable kernel's s0 + s1, at the
    extremes too (all +12 or all -12 against 127s)."""
    rng = np.random.default_rng(11)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    q3[0], q3[1] = 0x77, 0xFF
    x8 = rng.integers(-127, 128, nb * 32).astype(np.int8)
    x8[:64] = 127
    x8p = x8.reshape(nb, 2, 16).transpose(0, 2, 1).reshape(-1).copy()  # quantize_act's interleaving
    portable = np.zeros((nb, 2, TILE_ROWS), np.int16)
    for b in range(nb):
        mx.block_sums_portable(q3, b, x8p, portable[b])
    vnni, quads = np.zeros((nb, TILE_ROWS), np.int32), np.zeros((nb, TILE_ROWS), np.int32)
    _vnni_sums(q3, x8, vnni, quads, np.zeros(mx.QUADS_BYTES, np.uint8))
    offset = mx.VNNI_OFFSET * x8.reshape(nb, 32).astype(np.int32).sum(axis=1)
    np.testing.assert_array_equal(vnni - offset[:, None], portable.astype(np.int32).sum(axis=1))
    np.testing.assert_array_equal(quads, vnni)
    assert int(vnni[0, 0] - offset[0]) == 12 * 127 * 32
