"""Every Numba kernel against its NumPy twin in localllm.kernels.reference.

Tolerances (errors are measured relative to the largest |value| of the reference output):
  * matmul, integer path (quantized types; with AVX2 at every T, else T <= 12): the activations
    are rounded to int8 per 32-block (error <= max|x_block| / 254 per element), as llama.cpp does;
    the dot product's error is then ~0.5% of the output range, so 2.5e-2.  The integer arithmetic
    itself is checked tightly (1e-5) against the reference fed the same rounded activations, and
    the AVX2 IR kernels against the portable loops bit for bit.
  * matmul, float path (F32/F16/BF16/Q2_K/Q3_K; quantized types above T=12 without AVX2): 1e-5,
    float32 with another summation order and fused multiply-adds.
  * embedding: bit-exact (same dequantization formulas).
  * rms_norm, rope, store_kv: 1e-6 (same float32 operations, another order).
  * swiglu, geglu, attention: 1e-5 -- exp is a vectorisable polynomial (~2 ulp), and attention's
    online softmax sums in another order.
  * the real SmolLM2 model (marked slow): same greedy tokens as the NumPy backend, logits within
    8% of the largest (int8 activation error compounded over 30 layers; measured ~4%).
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
from numba import njit
from random_weights import random_weight

from localllm.backends.numba_cpu import NumbaBackend
from localllm.backends.numpy_ref import NumpyBackend
from localllm.kernels import attention, layers, matmul, simd_x86, simd_x86_quads, simd_x512
from localllm.kernels import matmul_int as mi
from localllm.kernels import reference as ref
from localllm.kernels.packing import KIND_OF_GGML, TILE_ROWS
from localllm.kernels.quantize_act import quantize_rows
from localllm.kernels.simd_x86 import HAVE_AVX2, HAVE_VNNI256, PAIRS_BYTES, q5_high_sums_avx2
from localllm.kernels.simd_x512 import HAVE_AVX512, HAVE_VNNI, QUADS_BYTES
from localllm.models.spec import RopeSpec

T = gguf.GGMLQuantizationType
LANE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
ROW_TYPES = ["F32", "F16", "BF16", "Q2_K", "Q3_K"]
FLOAT_TOL, INT_TOL, INT_EXACT_TOL = 1e-5, 2.5e-2, 1e-5


@pytest.fixture(scope="module")
def backend() -> NumbaBackend:
    return NumbaBackend(2)


def rel_err(ours: np.ndarray, expected: np.ndarray) -> float:
    assert ours.shape == expected.shape and ours.dtype == np.float32
    return float(np.abs(ours - expected).max() / max(np.abs(expected).max(), 1e-30))


def dequantized_activations(x: np.ndarray, rounding: int = matmul.ROUND_Q8_0) -> np.ndarray:
    """NumPy twin of quantize_rows, back to float: what the integer path multiplies with."""
    x8, dx, _ = ref.quantize_activations(x, rounding)
    return (x8.reshape(x.shape[0], -1, 32) * dx[..., None]).reshape(x.shape).astype(np.float32)


def integer_path_twin(x: np.ndarray, raw: np.ndarray, name: str) -> np.ndarray:
    """What the integer path computes, in NumPy: x rounded as for this weight, times the dequantized
    weight; for Q4_1 / Q5_1 the minimum terms take Q8_1's float16 sums instead of d * sum(x8)."""
    rounding = matmul.rounding_of(KIND_OF_GGML[T[name]])
    y = ref.linear(dequantized_activations(x, rounding), raw, T[name])
    if rounding == matmul.ROUND_Q8_1:
        x8, dx, sx = ref.quantize_activations(x, rounding)
        sums = x8.reshape(x.shape[0], -1, 32).astype(np.int32).sum(axis=-1).astype(np.float32)
        size = {"Q4_1": 20, "Q5_1": 24}[name]  # (d, m) float16 lead each block
        mins = raw.view(np.uint8).reshape(raw.shape[0], -1, size)[:, :, 2:4].copy().view(np.float16)[..., 0]
        y = y + (sx - dx * sums) @ mins.astype(np.float32).T
    return y.astype(np.float32)


# ---- matmul -----------------------------------------------------------------------------------

# (rows, cols): rows not a multiple of the row tile, and the smallest K-quant row.
SHAPES = [(70, 512), (33, 256)]


@pytest.mark.parametrize("name", LANE_TYPES + ROW_TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("t", [1, 3, 17])
def test_linear_matches_reference(name: str, n: int, k: int, t: int) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{name} {n} {t}".encode()))
    raw = random_weight(rng, name, n, k)
    w = matmul.prepare_weight(raw, T[name])
    x = rng.standard_normal((t, k)).astype(np.float32)
    y = matmul.linear(x, w, nth=2)
    expected = ref.linear(x, raw, T[name])
    if name in LANE_TYPES and t <= matmul.INT_PATH_MAX_T:
        assert rel_err(y, expected) < INT_TOL
        assert rel_err(y, integer_path_twin(x, raw, name)) < INT_EXACT_TOL
    else:
        assert rel_err(y, expected) < FLOAT_TOL


@pytest.mark.parametrize("name", LANE_TYPES + ROW_TYPES)
@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_linear_with_small_and_large_activations(name: str, scale: float) -> None:
    """Real models have activation outliers in the hundreds (Qwen2.5: ~180). A scale conversion that
    fastmath could reassociate into an overflow once turned such rows into NaN."""
    rng = np.random.default_rng(zlib.crc32(f"scale {name}".encode()))
    raw = random_weight(rng, name, 64, 512)
    w = matmul.prepare_weight(raw, T[name])
    x = (rng.standard_normal((2, 512)) * scale).astype(np.float32)
    y = matmul.linear(x, w, nth=2)
    assert np.isfinite(y).all()
    tol = INT_TOL if name in LANE_TYPES else FLOAT_TOL
    assert rel_err(y, ref.linear(x, raw, T[name])) < tol


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_linear_serial_parallel_and_both_paths_agree(name: str) -> None:
    """Same result on 1 or 2 threads; the integer and float paths agree within INT_TOL."""
    rng = np.random.default_rng(1)
    raw = random_weight(rng, name, 3 * TILE_ROWS + 5, 512)
    w = matmul.prepare_weight(raw, T[name])
    x = rng.standard_normal((4, 512)).astype(np.float32)
    fi, ff = w.kernels
    ys = []
    for fn, rounding in ((fi, matmul.rounding_of(w.kind)), (ff, matmul.ROUND_NONE)):
        y1, y2 = np.empty((4, w.n), np.float32), np.empty((4, w.n), np.float32)
        matmul.launch_linear_serial(fn, w.gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y1)
        matmul.launch_linear(fn, w.gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y2, 2)
        np.testing.assert_array_equal(y1, y2)
        ys.append(y1)
    assert rel_err(ys[0], ys[1]) < INT_TOL


@pytest.mark.parametrize("t", [1, 17])
def test_linear_many_equals_separate_linears(backend: NumbaBackend, t: int) -> None:
    """A Q4_K_M-like group: mixed kinds (Q4_K, Q6_K, F16) and sizes, one launch."""
    rng = np.random.default_rng(13)
    names, sizes = ["Q4_K", "Q6_K", "F16"], [70, 3 * TILE_ROWS, 5]
    raws = [random_weight(rng, nm, n, 256) for nm, n in zip(names, sizes, strict=True)]
    ws = [backend.prepare_weight(r, T[nm]) for r, nm in zip(raws, names, strict=True)]
    x = rng.standard_normal((t, 256)).astype(np.float32)
    outs = backend.linear_many(x, ws)
    for out, w in zip(outs, ws, strict=True):
        np.testing.assert_array_equal(out, backend.linear(x, w))


@pytest.mark.parametrize("name", LANE_TYPES + ROW_TYPES)
def test_embedding_is_exact(name: str) -> None:
    rng = np.random.default_rng(2)
    raw = random_weight(rng, name, 40, 256)
    w = matmul.prepare_weight(raw, T[name])
    ids = np.array([0, 39, 31, 32, 5, 5])
    np.testing.assert_array_equal(matmul.embedding(w, ids), ref.embedding(raw, T[name], ids))


@pytest.mark.parametrize("name", LANE_TYPES)
def test_packed_size_stays_close_to_the_file(name: str) -> None:
    raw = random_weight(np.random.default_rng(3), name, 4 * TILE_ROWS, 512)
    assert matmul.prepare_weight(raw, T[name]).nbytes <= 1.03 * raw.nbytes


@pytest.mark.parametrize("rounding", [matmul.ROUND_Q8_0, matmul.ROUND_Q8_1, matmul.ROUND_Q8_K])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_quantize_rows_equals_numpy_twin_bit_for_bit(layout: str, rounding: int) -> None:
    """The vector block kernel (contiguous rows) and the scalar passes (rows with gaps) both give NumPy's
    values exactly (reference.quantize_activations: ggml's Q8_0, Q8_1 or Q8_K), over magnitudes from
    tiny (float16 subnormal scales) to large (scales past float16's range)."""
    rng = np.random.default_rng(5)
    wide = (rng.standard_normal((7, 2 * 256)) * np.exp(rng.uniform(-20, 20, (7, 1)))).astype(np.float32)
    wide[2, 64:128] = 0.0  # all-zero blocks
    x = wide[:, :256] if layout == "contiguous" else wide[:, ::2]
    x = np.ascontiguousarray(x) if layout == "contiguous" else x
    assert x.flags.c_contiguous == (layout == "contiguous")
    x8, dx, sx, hs, x8p = quantize_rows(x, rounding)
    want8, want_d, want_s = ref.quantize_activations(np.ascontiguousarray(x), rounding)
    np.testing.assert_array_equal(x8, want8)
    np.testing.assert_array_equal(dx, want_d)
    halves = want8.reshape(7, -1, 16).astype(np.int32).sum(axis=-1)
    np.testing.assert_array_equal(hs, halves)
    np.testing.assert_array_equal(sx, want_s)
    pairs = np.stack([want8.reshape(7, -1, 2, 16)[:, :, 0], want8.reshape(7, -1, 2, 16)[:, :, 1]], axis=-1)
    np.testing.assert_array_equal(x8p, pairs.reshape(7, 256))


def test_quantize_rows_matches_numpy_twin() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 96)).astype(np.float32) * 5
    x[1, 32:64] = 0.0  # an all-zero block
    x8, dx, sx, hs, x8p = quantize_rows(x, matmul.ROUND_Q8_K)  # (K = 96: per 32 even where asked for Q8_K)
    pairs = np.stack([x8.reshape(3, -1, 2, 16)[:, :, 0], x8.reshape(3, -1, 2, 16)[:, :, 1]], axis=-1)
    np.testing.assert_array_equal(x8p, pairs.reshape(3, 96))  # (x[j], x[16 + j]) side by side
    back = (x8.astype(np.float32).reshape(3, -1, 32) * dx[..., None]).reshape(3, 96)
    np.testing.assert_allclose(back, dequantized_activations(x), rtol=1e-6, atol=1e-7)
    assert np.abs(x8).max() <= 127
    halves = x8.reshape(3, -1, 16).astype(np.int32).sum(axis=-1)
    np.testing.assert_array_equal(hs, halves)
    np.testing.assert_allclose(sx, dx * halves.reshape(3, -1, 2).sum(axis=-1), rtol=1e-6)


@pytest.mark.skipif(not HAVE_AVX2, reason="needs an AVX2 CPU")
def test_avx2_block_sums_equal_portable_ones() -> None:
    """The LLVM-IR AVX2 kernels and the portable loops give the same integer sums (the totals;
    the int16 partials are split differently)."""
    rng = np.random.default_rng(12)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    q4 = rng.integers(-128, 128, (nb, 8, TILE_ROWS, 4), dtype=np.int8)
    xr = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    xp = interleaved(xr)
    sums = [np.zeros((nb, TILE_ROWS), np.int16) for _ in range(6)]
    mi.nibble_sums_portable(q3, xp, sums[0], sums[1], True)
    run_overloaded(q3, xp, xr, sums[2], sums[3], sums[4], sums[5])
    low, high = q3 & 15, q3 >> 4  # (nb, 16, R)
    xb = xr.reshape(nb, 2, 16).astype(np.int32)
    exact = np.einsum("bjr,bj->br", low, xb[:, 0]) + np.einsum("bjr,bj->br", high, xb[:, 1])
    np.testing.assert_array_equal(sums[0].astype(np.int32) + sums[1], exact)
    expected = sums[0].astype(np.int32) + sums[1]
    np.testing.assert_array_equal(sums[2].astype(np.int32) + sums[3], expected)
    np.testing.assert_array_equal(sums[4], sums[0])  # split: exactly the low / high nibbles
    np.testing.assert_array_equal(sums[5], sums[1])
    s_port, s_avx = np.zeros((nb, TILE_ROWS), np.int32), np.zeros((nb, TILE_ROWS), np.int32)
    mi.q8_sums_portable(q4, xr, s_port)
    run_q8(q4, xr, s_avx)
    np.testing.assert_array_equal(s_avx, s_port)
    exact = np.einsum("bgre,bge->br", q4.astype(np.int32), xr.reshape(nb, 8, 4).astype(np.int32))
    np.testing.assert_array_equal(s_port, exact)
    x16 = rng.integers(-32767, 32768, nb * 32, dtype=np.int16)  # the precise path's activations
    mi.q8_sums_portable(q4, x16, s_port)
    run_q8(q4, x16, s_avx)
    np.testing.assert_array_equal(s_avx, s_port)
    exact = np.einsum("bgre,bge->br", q4.astype(np.int64), x16.reshape(nb, 8, 4).astype(np.int64))
    np.testing.assert_array_equal(s_port, exact)


def block_kernel_loop(block, x_bytes: int):
    """A loop calling one Q8_0 block kernel for every block (as matmul_int.q8_sums does)."""

    @njit
    def run(q4, xr, s):
        q, x, out = q4.ctypes.data, xr.ctypes.data, s.ctypes.data
        for b in range(q4.shape[0]):
            block(q + b * 32 * TILE_ROWS, x + b * x_bytes, out + b * 4 * TILE_ROWS, 0)

    return run


Q8_WIDE_KERNELS = {  # int16-activation Q8_0 block kernels: (needed CPU feature, kernel)
    "avx2": (HAVE_AVX2, "simd_x86.q8_block_sums16_avx2"),
    "avx512": (HAVE_AVX512, "simd_x512.q8_block_sums16_avx512"),
    "vnni": (HAVE_VNNI, "simd_x512.q8_block_sums16_vnni"),
}


@pytest.mark.parametrize("variant", list(Q8_WIDE_KERNELS))
def test_q8_wide_kernels_equal_portable_ones(variant: str) -> None:
    """Every SIMD variant of the int16-activation Q8_0 sums (the output projection's) that this CPU
    runs gives the portable loop's integer sums, bit for bit, extreme values included."""
    available, name = Q8_WIDE_KERNELS[variant]
    if not available:
        pytest.skip(f"needs a CPU with {variant}")
    module, attr = name.split(".")
    block = getattr({"simd_x86": simd_x86, "simd_x512": simd_x512}[module], attr)
    rng = np.random.default_rng(15)
    nb = 7
    q4 = rng.integers(-128, 128, (nb, 8, TILE_ROWS, 4), dtype=np.int8)
    x16 = rng.integers(-32767, 32768, nb * 32, dtype=np.int16)
    q4[0], x16[:32] = -128, -32767  # the largest sums: 32 * 128 * 32767
    q4[1], x16[32:64] = 127, 32767
    s_port, s_simd = np.zeros((nb, TILE_ROWS), np.int32), np.ones((nb, TILE_ROWS), np.int32)
    mi.q8_sums_portable(q4, x16, s_port)
    block_kernel_loop(block, 64)(q4, x16, s_simd)
    np.testing.assert_array_equal(s_simd, s_port)


Q8_KERNELS = {  # int8-activation Q8_0 block kernels
    "avx2": (HAVE_AVX2, "simd_x86.q8_block_sums_avx2"),
    "avxvnni": (HAVE_VNNI256, "simd_x86.q8_block_sums_avxvnni"),
    "vnni": (HAVE_VNNI, "simd_x512.q8_block_sums_vnni"),
}


@pytest.mark.parametrize("variant", list(Q8_KERNELS))
def test_q8_kernels_equal_portable_ones(variant: str) -> None:
    """Every SIMD variant of the int8-activation Q8_0 sums this CPU runs gives the portable loop's
    integer sums, bit for bit, extremes included."""
    available, name = Q8_KERNELS[variant]
    if not available:
        pytest.skip(f"needs a CPU with {variant}")
    module, attr = name.split(".")
    block = getattr({"simd_x86": simd_x86, "simd_x512": simd_x512}[module], attr)
    rng = np.random.default_rng(20)
    nb = 7
    q4 = rng.integers(-128, 128, (nb, 8, TILE_ROWS, 4), dtype=np.int8)
    x8 = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    q4[0], x8[:32] = -128, -127
    q4[1], x8[32:64] = 127, 127
    q4[2], x8[64:96] = -128, 127
    s_port, s_simd = np.zeros((nb, TILE_ROWS), np.int32), np.ones((nb, TILE_ROWS), np.int32)
    mi.q8_sums_portable(q4, x8, s_port)
    block_kernel_loop(block, 32)(q4, x8, s_simd)
    np.testing.assert_array_equal(s_simd, s_port)


NIBBLE_KERNELS = {  # 4-bit nibble block kernels (interleaved activations)
    "avx2": (HAVE_AVX2, "simd_x86.q4_block_sums_avx2"),
    "avx512": (HAVE_AVX512, "simd_x512.q4_block_sums_avx512"),
}


def nibble_kernel_loop(block):
    """A loop calling one nibble block kernel for every block (as matmul_int.nibble_sums does)."""

    @njit
    def run(q3, xp, s0, s1):
        q, x, a, b = q3.ctypes.data, xp.ctypes.data, s0.ctypes.data, s1.ctypes.data
        for i in range(q3.shape[0]):
            block(q + i * 16 * TILE_ROWS, x + i * 32, a + i * 2 * TILE_ROWS, b + i * 2 * TILE_ROWS)

    return run


@pytest.mark.parametrize("variant", list(NIBBLE_KERNELS))
def test_nibble_kernels_equal_portable_ones(variant: str) -> None:
    """Every SIMD variant of the single-row nibble sums this CPU runs: the portable loop's totals,
    and the same int16 partials (s0: pairs j < 8, s1: j >= 8) as the numpy sums, extremes included."""
    available, name = NIBBLE_KERNELS[variant]
    if not available:
        pytest.skip(f"needs a CPU with {variant}")
    module, attr = name.split(".")
    block = getattr({"simd_x86": simd_x86, "simd_x512": simd_x512}[module], attr)
    rng = np.random.default_rng(17)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    xr = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    q3[0], xr[:32] = 255, -127  # the largest partials: 8 * 2 * 15 * 127
    xp = interleaved(xr)
    port = [np.zeros((nb, TILE_ROWS), np.int16) for _ in range(2)]
    simd = [np.ones((nb, TILE_ROWS), np.int16) for _ in range(2)]
    mi.nibble_sums_portable(q3, xp, port[0], port[1], True)
    nibble_kernel_loop(block)(q3, xp, simd[0], simd[1])
    np.testing.assert_array_equal(simd[0].astype(np.int32) + simd[1], port[0].astype(np.int32) + port[1])
    low, high = (q3 & 15).astype(np.int32), (q3 >> 4).astype(np.int32)
    xb = xr.reshape(nb, 2, 16).astype(np.int32)
    for half, js in enumerate((slice(0, 8), slice(8, 16))):
        part = np.einsum("bjr,bj->br", low[:, js], xb[:, 0, js]) + np.einsum(
            "bjr,bj->br", high[:, js], xb[:, 1, js]
        )
        np.testing.assert_array_equal(simd[half], part)


@pytest.mark.skipif(not HAVE_VNNI, reason="needs a CPU with AVX512-VNNI")
def test_int32_nibble_sums_equal_numpy_ones() -> None:
    """The VNNI one-row nibble sums (plain activations, int32 in row order): the numpy sums of every
    block, bit for bit, the largest and the most negative totals included."""
    rng = np.random.default_rng(23)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    xr = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    q3[0], xr[:32] = 255, 127
    q3[1], xr[32:64] = 255, -128
    sums = np.ones((nb, TILE_ROWS), np.int32)

    @njit
    def run(q3, xr, s):
        q, x, o = q3.ctypes.data, xr.ctypes.data, s.ctypes.data
        for i in range(q3.shape[0]):
            simd_x512.q4_block_sums_vnni(q + i * 16 * TILE_ROWS, x + i * 32, o + i * 4 * TILE_ROWS, 0)

    run(q3, xr, sums)
    low, high = (q3 & 15).astype(np.int64), (q3 >> 4).astype(np.int64)
    xb = xr.reshape(nb, 2, 16).astype(np.int64)
    want = np.einsum("bjr,bj->br", low, xb[:, 0]) + np.einsum("bjr,bj->br", high, xb[:, 1])
    np.testing.assert_array_equal(sums, want)


@pytest.mark.skipif(not HAVE_VNNI, reason="needs a CPU with AVX512-VNNI")
def test_int32_q6_sums_equal_numpy_ones() -> None:
    """The VNNI Q6_K block sums of one and of two activation rows: each half's sums of the six-bit values
    (nibble + 16 x crumb, 0..63) times x, as numpy computes them, extremes included."""
    rng = np.random.default_rng(29)
    nb = 5
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    qh = rng.integers(0, 256, (nb, 8, TILE_ROWS), dtype=np.uint8)
    xr = rng.integers(-128, 128, (2, nb * 32), dtype=np.int8)
    q3[0], qh[0], xr[0, :32], xr[1, :32] = 255, 255, 127, -128  # 63 everywhere
    one, two = np.ones((nb, 2, TILE_ROWS), np.int32), np.ones((nb, 4, TILE_ROWS), np.int32)

    @njit
    def run(q3, qh, xr, one, two):
        q, h, x, k = q3.ctypes.data, qh.ctypes.data, xr.ctypes.data, xr.shape[1]
        for i in range(q3.shape[0]):
            qb, hb, xb = q + i * 16 * TILE_ROWS, h + i * 8 * TILE_ROWS, x + i * 32
            simd_x512.q6_block_sums_vnni(qb, hb, xb, one[i].ctypes.data)
            simd_x512.q6_block_sums2_vnni(qb, hb, xb, xb + k, two[i].ctypes.data)

    run(q3, qh, xr, one, two)
    e = np.arange(32)
    nibbles = np.where(e[:, None] < 16, q3[:, e % 16] & 15, q3[:, e % 16] >> 4).astype(np.int64)
    crumbs = (qh[:, e % 8] >> (2 * (e // 8))[:, None]) & 3  # element e: byte e % 8, bits 2 * (e // 8)
    six = nibbles + 16 * crumbs.astype(np.int64)  # (nb, 32, R)
    for t in range(2):
        prod = six * xr[t].reshape(nb, 32, 1).astype(np.int64)
        want = np.stack([prod[:, :16].sum(1), prod[:, 16:].sum(1)], axis=1)
        np.testing.assert_array_equal(two[:, 2 * t : 2 * t + 2], want)
        if t == 0:
            np.testing.assert_array_equal(one, want)


Q6_KERNELS = {  # Q6_K block kernels on plain-order activations: (needed CPU feature, kernel, bytes per row)
    "split-avx2": (HAVE_AVX2, "simd_x86.q4_block_sums_split_avx2", 16),
    "split-avx512": (HAVE_AVX512, "simd_x512.q4_block_sums_split_avx512", 16),
    "crumbs-avx2": (HAVE_AVX2, "simd_x86.crumb_sums_avx2", 8),
    "crumbs-avx512": (HAVE_AVX512, "simd_x512.crumb_sums_avx512", 8),
}


def q6_kernel_loop(block, q_rows: int):
    """A loop calling one Q6_K block kernel for every block (as matmul_int._block_loop does)."""

    @njit
    def run(q3, xr, s0, s1):
        q, x, a, b = q3.ctypes.data, xr.ctypes.data, s0.ctypes.data, s1.ctypes.data
        for i in range(q3.shape[0]):
            block(q + i * q_rows * TILE_ROWS, x + i * 32, a + i * 2 * TILE_ROWS, b + i * 2 * TILE_ROWS)

    return run


@pytest.mark.parametrize("variant", list(Q6_KERNELS))
def test_q6_kernels_equal_portable_ones(variant: str) -> None:
    """Every SIMD variant of Q6_K's nibble halves and crumb sums this CPU runs gives the portable
    loop's int16 sums bit for bit (and numpy's), extremes included."""
    available, name, q_rows = Q6_KERNELS[variant]
    if not available:
        pytest.skip(f"needs a CPU with {variant.split('-')[1]}")
    module, attr = name.split(".")
    block = getattr({"simd_x86": simd_x86, "simd_x512": simd_x512}[module], attr)
    rng = np.random.default_rng(18)
    nb = 6
    q3 = rng.integers(0, 256, (nb, q_rows, TILE_ROWS), dtype=np.uint8)
    xr = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    q3[0], xr[:32] = 255, -127  # the largest sums
    q3[1], xr[32:64] = 255, 127
    port = [np.zeros((nb, TILE_ROWS), np.int16) for _ in range(2)]
    simd = [np.ones((nb, TILE_ROWS), np.int16) for _ in range(2)]
    if q_rows == 16:
        mi.nibble_sums_portable(q3, xr, port[0], port[1], False)
        parts = np.stack([q3 & 15, q3 >> 4], axis=1)  # (nb, 2, 16, R): elements 16 * half + j
    else:
        mi.crumb_sums_portable(q3, xr, port[0], port[1])
        crumbs = np.stack([(q3 >> (2 * i)) & 3 for i in range(4)], axis=1)  # element 8 * i + j
        parts = crumbs.reshape(nb, 2, 16, TILE_ROWS)
    q6_kernel_loop(block, q_rows)(q3, xr, simd[0], simd[1])
    xb = xr.reshape(nb, 2, 16).astype(np.int32)
    for half in range(2):
        exact = np.einsum("bjr,bj->br", parts[:, half].astype(np.int32), xb[:, half])
        np.testing.assert_array_equal(port[half], exact)
        np.testing.assert_array_equal(simd[half], port[half])


@pytest.mark.skipif(not HAVE_AVX512, reason="needs an AVX-512 CPU")
def fifth_bit_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Five blocks of random fifth bits (the first all set) and two activation rows (the second's first
    two blocks at -127): the inputs both fifth-bit kernels are checked on."""
    rng = np.random.default_rng(seed)
    qh3 = rng.integers(0, 1 << 16, (5, 2, TILE_ROWS), dtype=np.uint16)
    qh3[0] = 0xFFFF
    x8 = rng.integers(-127, 128, (2, 5 * 32), dtype=np.int8)
    x8[1, :64] = -127
    return qh3, x8


def test_fifth_bit_table_sums_equal_portable_ones() -> None:
    """Q5's fifth-bit sums by table lookups (AVX-512) equal the portable loop's, bit for bit, for
    random bits, all bits set and extreme activations."""
    qh3, x8 = fifth_bit_case(16)
    nb = qh3.shape[0]
    bits = np.zeros((2, nb * mi.BIT_TABLE_LEN), np.int16)
    run_bit_tables(x8, bits)
    for t in range(2):
        s_port, s_simd = np.zeros((nb, TILE_ROWS), np.int16), np.ones((nb, TILE_ROWS), np.int16)
        mi.high_bit_sums(qh3, x8[t], s_port)
        run_high_bits(qh3, x8[t], bits[t], s_simd)
        np.testing.assert_array_equal(s_simd, s_port)
        set_bits = (qh3[:, :, None, :] >> np.arange(16)[None, None, :, None]) & 1  # (nb, 2, 16, R)
        xw = x8[t].reshape(nb, 2, 16).astype(np.int32)
        exact = np.einsum("bwjr,bwj->br", set_bits.astype(np.int32), xw)
        np.testing.assert_array_equal(s_port, exact)


@pytest.mark.skipif(not HAVE_AVX2, reason="needs an AVX2 CPU")
def test_fifth_bit_sums_avx2_equal_portable_ones() -> None:
    """The decode-row kernel's AVX2 fifth-bit sums (lane masks, pair-interleaved x) equal the portable
    loop's, bit for bit: random bits, all bits set, extreme activations."""
    qh3, x8 = fifth_bit_case(17)
    nb = qh3.shape[0]
    for t in range(2):
        s_port, s_avx2 = np.zeros((nb, TILE_ROWS), np.int16), np.ones((nb, TILE_ROWS), np.int16)
        mi.high_bit_sums(qh3, x8[t], s_port)
        run_high_bits_avx2(qh3, interleaved(x8[t]), s_avx2)
        np.testing.assert_array_equal(s_avx2, s_port)


@njit
def run_high_bits_avx2(qh3, xp, sh):
    q, x, s = qh3.ctypes.data, xp.ctypes.data, sh.ctypes.data
    for b in range(qh3.shape[0]):
        q5_high_sums_avx2(q + b * 4 * TILE_ROWS, x + b * 32, s + b * 2 * TILE_ROWS, 0)


@njit
def run_bit_tables(x8, bits):
    mi.bit_tables(x8, bits)


@njit
def run_high_bits(qh3, xr, tables, sh):
    mi.high_bit_sums_tables(qh3, xr, tables, sh)


@pytest.mark.skipif(not HAVE_AVX2, reason="needs an AVX2 CPU")
def test_unpacked_pair_sums_equal_direct_ones() -> None:
    """Several activation rows share one unpacking of the weight nibbles: same sums as one row at
    a time (the kernel a lone decode row uses)."""
    rng = np.random.default_rng(14)
    nb, rows = 5, 3
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    x8 = rng.integers(-127, 128, (rows, nb * 32), dtype=np.int8)
    many = np.zeros((2, rows, nb, TILE_ROWS), np.int16)
    x8 = np.stack([interleaved(row) for row in x8])
    run_rows(q3, x8, many[0], many[1], np.empty(PAIRS_BYTES, np.uint8))
    for t in range(rows):
        lo, hi = np.zeros((nb, TILE_ROWS), np.int16), np.zeros((nb, TILE_ROWS), np.int16)
        run_one(q3, x8[t], lo, hi)
        np.testing.assert_array_equal(many[0, t], lo)
        np.testing.assert_array_equal(many[1, t], hi)


@njit
def run_rows(q3, x8, lo, hi, pairs):
    mi.nibble_sums_rows(q3, x8, 0, x8.shape[0], lo, hi, pairs)


@njit
def run_one(q3, xr, lo, hi):
    mi.nibble_sums(q3, xr, lo, hi)


def exact_quad_sums(q3, qh, xr, kind: str) -> np.ndarray:
    """numpy's int32 sums of the unsigned quants times x per block (Q6_K: per half block)."""
    nb = q3.shape[0]
    q = np.concatenate([q3 & 15, q3 >> 4], axis=1).astype(np.int64)  # (nb, 32, R), element e
    if kind == "q5":
        q += 16 * ((qh[:, :, None, :] >> np.arange(16)[None, None, :, None]) & 1).reshape(nb, 32, -1)
    if kind == "q6":
        q += 16 * np.stack([(qh >> (2 * i)) & 3 for i in range(4)], axis=1).reshape(nb, 32, -1)
    xb = xr.reshape(nb, 2, 16).astype(np.int64)
    halves = np.einsum("bhjr,bhj->bhr", q.reshape(nb, 2, 16, -1), xb)
    return halves if kind == "q6" else halves.sum(axis=1)


@pytest.mark.parametrize("kind", ["q4", "q5", "q6"])
def test_quad_sums_equal_portable_ones(kind: str) -> None:
    """Many rows over one unpacking into quads (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`; else the
    portable loop per row) give the portable twin's int32 sums bit for bit, and numpy's, extremes
    included; the twin also equals the int16 kernels' partials combined (what the lone-row path hands
    on)."""
    rng = np.random.default_rng(19)
    nb, rows = 5, 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    qh = {
        "q4": np.zeros((0, 2, TILE_ROWS), np.uint16),
        "q5": rng.integers(0, 1 << 16, (nb, 2, TILE_ROWS), dtype=np.uint16),
        "q6": rng.integers(0, 256, (nb, 8, TILE_ROWS), dtype=np.uint8),
    }[kind]
    x8 = rng.integers(-127, 128, (rows, nb * 32), dtype=np.int8)
    q3[0], x8[0, :32], x8[1, 32:64] = 255, -127, 127
    if kind != "q4":
        qh[0] = np.iinfo(qh.dtype).max
    shape = (rows, nb, 2, TILE_ROWS) if kind == "q6" else (rows, nb, TILE_ROWS)
    many = np.ones(shape, np.int32)
    (run_q6_rows if kind == "q6" else run_quad_rows)(q3, qh, x8, many, np.zeros(QUADS_BYTES, np.uint8))
    for t in range(rows):
        port = np.zeros(shape[1:], np.int32)
        if kind == "q6":
            mi.q6_sums32_portable(q3, qh, x8[t], port)
        else:
            mi.nibble_sums32_portable(q3, qh, x8[t], port)
        np.testing.assert_array_equal(port, exact_quad_sums(q3, qh, x8[t], kind))
        np.testing.assert_array_equal(many[t], port)


def quads_kernel_loop(unpack, sums, h_bytes: int, s_bytes: int):
    """A loop that unpacks each block with one simd_x86_quads kernel and sums one row with another."""

    @njit
    def run(q3, qh, xr, s32, quads):
        q, h, x, out, p = q3.ctypes.data, qh.ctypes.data, xr.ctypes.data, s32.ctypes.data, quads.ctypes.data
        for b in range(q3.shape[0]):
            unpack(q + b * 16 * TILE_ROWS, h + b * h_bytes, p)
            sums(p, x + b * 32, out + b * s_bytes)

    return run


AVX2_QUAD_SUMS = {  # (needed CPU feature, sums kernel by kind)
    "avx2": (HAVE_AVX2, {"q4": "q4_quad_sums_avx2", "q5": "q5_quad_sums_avx2", "q6": "q6_quad_sums_avx2"}),
    "avxvnni": (
        HAVE_VNNI256,
        {"q4": "quad_sums_avxvnni", "q5": "quad_sums_avxvnni", "q6": "quad_sums_split_avxvnni"},
    ),
}


@pytest.mark.parametrize("variant", list(AVX2_QUAD_SUMS))
@pytest.mark.parametrize("kind", ["q4", "q5", "q6"])
def test_avx2_quad_kernels_equal_numpy_sums(kind: str, variant: str) -> None:
    """The 256-bit quads kernels (`vpmaddubsw` + `vpmaddwd`, or AVX-VNNI's `vpdpbusd`), called directly
    on any CPU that has their instructions (on AVX-512 machines the dispatch takes simd_x512's): numpy's
    int32 sums bit for bit, the largest values against +-127 included."""
    available, names = AVX2_QUAD_SUMS[variant]
    if not available:
        pytest.skip(f"needs a CPU with {variant}")
    rng = np.random.default_rng(23)
    nb = 6
    q3 = rng.integers(0, 256, (nb, 16, TILE_ROWS), dtype=np.uint8)
    qh = {
        "q4": np.zeros((nb, 2, TILE_ROWS), np.uint16),
        "q5": rng.integers(0, 1 << 16, (nb, 2, TILE_ROWS), dtype=np.uint16),
        "q6": rng.integers(0, 256, (nb, 8, TILE_ROWS), dtype=np.uint8),
    }[kind]
    x8 = rng.integers(-127, 128, nb * 32, dtype=np.int8)
    q3[:2], qh[:2], x8[:32], x8[32:64] = 255, np.iinfo(qh.dtype).max, -127, 127
    unpack = getattr(simd_x86_quads, f"{kind}_unpack_quads_avx2")
    sums = getattr(simd_x86_quads, names[kind])
    halves = 2 if kind == "q6" else 1
    out = np.ones((nb, halves, TILE_ROWS), np.int32)
    run = quads_kernel_loop(unpack, sums, qh[0].nbytes if kind != "q4" else 0, halves * TILE_ROWS * 4)
    run(q3, qh, x8, out, np.zeros(QUADS_BYTES, np.uint8))
    exact = exact_quad_sums(q3, qh if kind != "q4" else qh[:0], x8, kind)
    np.testing.assert_array_equal(out.reshape(exact.shape), exact)


@njit
def run_quad_rows(q3, qh, x8, s32, quads):
    mi.quad_sums_rows(q3, qh, x8, 0, x8.shape[0], s32, quads)


@njit
def run_q6_rows(q3, qh, x8, s32, quads):
    mi.q6_sums_rows(q3, qh, x8, 0, 0, x8.shape[0], s32, quads)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q8_0", "Q6_K"])
def test_a_row_does_not_depend_on_its_batch(backend: NumbaBackend, name: str) -> None:
    """Each activation row gives the same bits alone or among 20 others (chunks of 16 rows, the
    unpack-once path, a lone-row path): batched and lone decodes must pick the same tokens."""
    rng = np.random.default_rng(zlib.crc32(f"batch {name}".encode()))
    raw = random_weight(rng, name, TILE_ROWS + 9, 512)
    w = backend.prepare_weight(raw, T[name])
    x = rng.standard_normal((21, 512)).astype(np.float32)
    for op in (backend.linear, backend.linear_precise):
        together = op(x, w)
        for t in (0, 15, 16, 20):
            np.testing.assert_array_equal(op(x[t : t + 1], w)[0], together[t])
        for rows in (2, 3, 4, 8, 16):  # a few rows at once (matmul_row's kernels up to 8 or 16)
            np.testing.assert_array_equal(op(x[3 : 3 + rows], w), together[3 : 3 + rows])


def interleaved(xr: np.ndarray) -> np.ndarray:
    """quantize_rows' x8p layout of a row: each 32-block's x[j], x[16 + j] side by side."""
    return np.ascontiguousarray(xr.reshape(-1, 2, 16).transpose(0, 2, 1).reshape(-1))


@njit
def run_overloaded(q3, xp, xr, a, b, c, d):
    mi.nibble_sums(q3, xp, a, b)
    mi.nibble_sums_split(q3, xr, c, d)


@njit
def run_q8(q4, xr, s):
    mi.q8_sums(q4, xr, s)


# ---- layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 64), (17, 576), (5, 3, 64)])
def test_rms_norm(backend: NumbaBackend, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    weight = rng.standard_normal(shape[-1]).astype(np.float32)
    out = backend.rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape
    assert rel_err(out, ref.rms_norm(x, weight, 1e-5)) < 1e-6


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("t,rope_dim,freq_scale", [(1, 64, 1.0), (3, 64, 0.25), (17, 32, 1.0)])
def test_rope(backend: NumbaBackend, neox: bool, t: int, rope_dim: int, freq_scale: float) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((t, 3, 64)).astype(np.float32)
    v = np.zeros_like(x)
    positions = rng.integers(0, 4000, t)
    spec = RopeSpec(rope_dim, 10000.0, freq_scale, neox)
    cache = np.zeros((t, 1, 3, 64), np.float32)

    def rotated(pos: np.ndarray) -> np.ndarray:
        return backend.rope_store_kv(x, x, v, pos, spec, cache, cache.copy(), np.arange(t))[0]

    for _ in range(2):  # the second call reuses the cached cos/sin tables
        expected = ref.rope(x, positions, rope_dim, 10000.0, neox, freq_scale)
        assert rel_err(rotated(positions), expected) < 1e-6
    other = positions + 1  # same length, other values: the cache must not be reused
    expected = ref.rope(x, other, rope_dim, 10000.0, neox, freq_scale)
    assert rel_err(rotated(other), expected) < 1e-6


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", [(1, 1536), (17, 100)])
def test_gated_activations(backend: NumbaBackend, op: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(7)
    gate = rng.standard_normal(shape).astype(np.float32) * 4
    gate[0, :4] = [-100.0, 100.0, 0.0, -20.0]  # exp overflow / underflow territory
    up = rng.standard_normal(shape).astype(np.float32)
    out = getattr(backend, op)(gate, up)
    with np.errstate(over="ignore"):  # the reference's exp(100) overflows to inf (harmlessly)
        expected = getattr(ref, op)(gate, up)
    assert rel_err(out, expected) < 1e-5


def test_store_kv_rows() -> None:
    rng = np.random.default_rng(8)
    caches = [np.zeros((6, 4, 2, 8), np.float32) for _ in range(4)]
    k, v = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    slots = np.array([9, 10, 11, 0, 23])
    layers.store_kv_rows(caches[0], caches[1], k, v, slots)
    ref.store_kv(caches[2], caches[3], k, v, slots)
    np.testing.assert_array_equal(caches[0], caches[2])
    np.testing.assert_array_equal(caches[1], caches[3])


def test_rope_store_kv_equals_reference(backend: NumbaBackend) -> None:
    rng = np.random.default_rng(14)
    q = rng.standard_normal((5, 6, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 5, 2, 16)).astype(np.float32)
    positions, slots = np.array([3, 4, 5, 0, 9]), np.array([3, 4, 5, 8, 13])
    caches = [np.zeros((4, 4, 2, 16), np.float32) for _ in range(4)]
    spec = RopeSpec(16, 500.0, neox=True)
    q_rot, k_rot = backend.rope_store_kv(q, k, v, positions, spec, caches[0], caches[1], slots)
    assert rel_err(q_rot, ref.rope(q, positions, 16, 500.0, True)) < 1e-6
    assert rel_err(k_rot, ref.rope(k, positions, 16, 500.0, True)) < 1e-6
    ref.store_kv(caches[2], caches[3], k_rot, v, slots)
    np.testing.assert_array_equal(caches[0], caches[2])
    np.testing.assert_array_equal(caches[1], caches[3])


def test_kernel_entry_points_refuse_out_of_bounds_indices(backend: NumbaBackend) -> None:
    """A slot or block index past the cache is an exception at the entry point, not a wild write."""
    from localllm.backends.bounds import KernelBoundsError

    q = np.ones((2, 4, 16), np.float32)
    k = np.ones((2, 2, 16), np.float32)
    cache = np.zeros((3, 4, 2, 16), np.float32)
    with pytest.raises(KernelBoundsError, match="slot_mapping"):
        backend.rope_store_kv(q, k, k, np.arange(2), RopeSpec(16), cache, cache.copy(), np.array([0, 12]))
    qsl, ctx = np.array([0, 2]), np.array([2])
    with pytest.raises(KernelBoundsError, match="block_tables"):
        backend.paged_attention(q, cache, cache, qsl, ctx, np.array([[3]]), 0.25)
    with pytest.raises(KernelBoundsError, match="context_lens"):
        backend.paged_attention(q, cache, cache, qsl, np.array([9]), np.array([[0, 1]]), 0.25)
    with pytest.raises(KernelBoundsError, match="rms_norm weight"):
        backend.rms_norm(np.ones((2, 16), np.float32), np.ones(8, np.float32), 1e-5)
    with pytest.raises(KernelBoundsError, match="gate and up"):
        backend.swiglu(np.ones((2, 16), np.float32), np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        backend.linear(np.ones((2, 33), np.float32), backend.prepare_weight(np.zeros((8, 32), np.float32), 0))


# ---- attention --------------------------------------------------------------------------------


def attention_case(rng: np.random.Generator, block_size: int = 4):
    """Three sequences mixing a continued prefill chunk, a decode and a fresh prefill, with GQA
    (6 query heads on 2 KV heads), scattered blocks and partially filled last blocks."""
    n_q = [5, 1, 17]  # queries this step
    ctx = [12, 20, 17]  # cached positions after this step
    kvh, heads, d, n_blocks = 2, 6, 16, 24
    k_cache = rng.standard_normal((n_blocks, block_size, kvh, d)).astype(np.float32)
    v_cache = rng.standard_normal((n_blocks, block_size, kvh, d)).astype(np.float32)
    perm = rng.permutation(n_blocks)
    need = [(c + block_size - 1) // block_size for c in ctx]
    tables = np.zeros((3, max(need)), np.int32)
    start = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[start : start + nb]
        start += nb
    qsl = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], heads, d)).astype(np.float32)
    return q, k_cache, v_cache, qsl, np.array(ctx, np.int32), tables


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 1.5), (5, 1.5)])
def test_paged_attention_mixed_batch(backend: NumbaBackend, window: int, softcap: float) -> None:
    q, kc, vc, qsl, ctx, tables = attention_case(np.random.default_rng(9))
    expected = ref.paged_attention(q, kc, vc, qsl, ctx, tables, 0.25, window, softcap)
    got = backend.paged_attention(q, kc, vc, qsl, ctx, tables, 0.25, window, softcap)
    assert rel_err(got, expected) < 1e-5
    i64 = [a.astype(np.int64) for a in (qsl, ctx, tables)]
    args = (q, kc, vc, *i64, 0.25, window, softcap)
    serial, parallel = np.empty_like(q), np.empty_like(q)
    attention.paged_attention_serial(*args, serial)
    attention.paged_attention_par(*args, parallel, 2)
    assert rel_err(serial, expected) < 1e-5
    np.testing.assert_array_equal(serial, parallel)


def test_paged_attention_long_context_single_block_size() -> None:
    """A decode over 300 positions in blocks of 16: many online-softmax rescalings."""
    rng = np.random.default_rng(10)
    bs, length = 16, 300
    nb = (length + bs - 1) // bs
    kc = rng.standard_normal((nb + 3, bs, 1, 32)).astype(np.float32) * 3
    vc = rng.standard_normal((nb + 3, bs, 1, 32)).astype(np.float32)
    tables = rng.permutation(nb + 3)[None, :nb].astype(np.int32)
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    qsl, ctx = np.array([0, 1], np.int32), np.array([length], np.int32)
    out = NumbaBackend(1).paged_attention(q, kc, vc, qsl, ctx, tables, 0.2)
    assert rel_err(out, ref.paged_attention(q, kc, vc, qsl, ctx, tables, 0.2)) < 1e-5


# ---- the backend as a whole -------------------------------------------------------------------


def test_backend_matches_numpy_backend_shapes_and_dtypes(backend: NumbaBackend) -> None:
    rng = np.random.default_rng(11)
    nb = NumpyBackend()
    raw = random_weight(rng, "Q8_0", 64, 96)
    wn, wb = nb.prepare_weight(raw, T.Q8_0), backend.prepare_weight(raw, T.Q8_0)
    assert backend.prepare_weight(raw, T.Q8_0) is wb  # tied embeddings: packed once
    x = rng.standard_normal((3, 96)).astype(np.float32)
    for ours, theirs in [
        (backend.linear(x, wb), nb.linear(x, wn)),
        (backend.embedding(wb, np.array([3, 63])), nb.embedding(wn, np.array([3, 63]))),
        (backend.prepare_vector(x[0], 0), nb.prepare_vector(x[0], 0)),
    ]:
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == np.float32
        assert rel_err(ours, theirs) < INT_TOL
    k_ours = backend.allocate_kv(2, 3, 4, 1, 8)
    k_theirs = nb.allocate_kv(2, 3, 4, 1, 8)
    assert [a.shape for a in k_ours] == [a.shape for a in k_theirs]
    assert all(a.dtype == np.float32 for a in k_ours)


def test_warmup_runs(backend: NumbaBackend) -> None:
    backend.warmup()


# ---- the real model ---------------------------------------------------------------------------


def _batch(ids: list[int], start: int, blocks: list[int], block_size: int):
    from localllm.models.base import ForwardBatch

    pos = np.arange(start, start + len(ids))
    return ForwardBatch(
        input_ids=np.array(ids, np.int64),
        positions=pos,
        slot_mapping=np.array([blocks[p // block_size] * block_size + p % block_size for p in pos]),
        query_start_loc=np.array([0, len(ids)], np.int32),
        context_lens=np.array([start + len(ids)], np.int32),
        block_tables=np.array([blocks], np.int32),
        logits_indices=np.array([len(ids) - 1]),
    )


def _run_model(backend, path, index_dir, prompt: list[int], steps: int) -> np.ndarray:
    """Logits of the prompt's last token, then of `steps` greedy decode steps."""
    from localllm.engine.kv_cache import KVCache, KVLayout
    from localllm.loading.file import GGUFFile
    from localllm.models import load_model

    model = load_model(GGUFFile.open(path, index_dir), backend)
    a = model.args
    kv = KVCache(backend, KVLayout.of(a), 8, 16)
    blocks = [5, 2, 7, 0]  # scattered blocks
    logits = [model.forward(_batch(prompt, 0, blocks, 16), kv)[0]]
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(logits[-1])))
        logits.append(model.forward(_batch(ids[-1:], len(ids) - 1, blocks, 16), kv)[0])
    return np.array(logits)


@pytest.mark.slow
def test_smollm2_matches_numpy_backend(smollm2_path, index_dir) -> None:
    """A prefill and decode steps through all 30 layers: the same greedy tokens, and logits
    within the int8 activation error compounded over the layers (measured ~4% of the largest
    logit; llama.cpp quantizes activations the same way)."""
    prompt = [1, 504, 3458, 282, 4649, 314, 2295, 30, 378, 1090, 253, 3012, 28, 339, 5248, 260, 17, 9]
    ours = _run_model(NumbaBackend(2), smollm2_path, index_dir, prompt, 3)
    theirs = _run_model(NumpyBackend(), smollm2_path, index_dir, prompt, 3)
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()
    assert rel_err(ours, theirs) < 0.08


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_linear_precise_is_close_to_float_activations(backend: NumbaBackend, name: str) -> None:
    """16-bit activations (Q8_0) or two 8-bit passes (activations, then their rounding residual, over
    the tiles of each row's highest outputs: tests/kernels/test_refine.py) land within 1e-4 of the
    float32 result there, where one 8-bit pass is ~100x further off."""
    rng = np.random.default_rng(zlib.crc32(f"precise {name}".encode()))
    raw = random_weight(rng, name, 96, 512)
    w = backend.prepare_weight(raw, T[name])
    x = rng.standard_normal((3, 512)).astype(np.float32) * 20
    expected = ref.linear(x, raw, T[name])
    whole = name == "Q8_0"  # else refined where highest
    top = slice(None) if whole else (np.arange(3), expected.argmax(axis=1))
    assert rel_err(backend.linear_precise(x, w)[top], expected[top]) < 1e-4
    assert rel_err(backend.linear(x, w), expected) > 1e-3
