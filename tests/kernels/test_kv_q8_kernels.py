"""The q8_0 KV cache's kernels: the store writes ggml's Q8_0 bytes (as quant/'s NumPy quantizer, which
matches llama.cpp's reference) of each head rotated as llama.cpp rotates a quantized cache (kv_rotation:
heads of a size 64 divides); attention scores a q8_0 key as llama.cpp does (the query quantized to
Q8_0, integer dots per block) and equals the NumPy twin (kernels/reference) within float rounding."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from localllm.backends import bounds
from localllm.backends.kv_types import row_width
from localllm.kernels import attention, attention_q8, kv_rotation, layers, simd_i8
from localllm.kernels import reference as ref
from localllm.quant.ggml import BLOCK_Q8_0
from localllm.quant.quantize_legacy import quantize_q8_0

D, KVH, BS = 64, 2, 16
WIDTH = row_width("q8_0", D)  # 68 bytes: two blocks of 34


def _rows(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """k, v (n, KVH, D) of mixed magnitudes, with an all-zero block and exact .5 quants (ties)."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((2, n, KVH, D)) * rng.uniform(0.01, 30, (2, n, KVH, 1))).astype(np.float32)
    k[3, 0, :32] = 0.0
    k[4, 1, :32] = np.arange(32, dtype=np.float32) - 15.5  # d = 16.5 / 127: many halves after scaling
    return k, v


def _slots(tables: np.ndarray, n: int) -> np.ndarray:
    return tables[0, np.arange(n) // BS] * BS + np.arange(n) % BS


def _q8_pool(blocks: int = 3) -> list[np.ndarray]:
    return [np.zeros((blocks, BS, KVH, WIDTH), np.int8) for _ in range(2)]


def test_the_store_writes_ggml_q8_0_blocks_as_the_numpy_quantizer_does() -> None:
    k, v = _rows(0)
    tables = np.array([[2, 0, 1]], np.int64)
    pool, twin = _q8_pool(), _q8_pool()
    layers.store_kv_rows(*pool, k, v, _slots(tables, 40))
    ref.store_kv(*twin, k, v, _slots(tables, 40))
    np.testing.assert_array_equal(pool[0], twin[0])
    np.testing.assert_array_equal(pool[1], twin[1])
    row = pool[0][2, 0, 1]  # token 0's second head: block 2 holds tokens 0..15, rotated (D = 64)
    expected = quantize_q8_0(ref.hadamard(k[0, 1], 64).reshape(-1, 32))
    assert row.tobytes() == expected.tobytes() and expected.dtype.itemsize == 34
    rotated = ref.hadamard(k[:16], 64)
    back = ref.from_storage(pool[0], D)
    err = np.abs(back[2, :, :, :] - rotated).max(axis=-1)
    assert (err <= np.abs(rotated).max(axis=-1) / 127 * 0.6 + 1e-6).all()  # half a step (f16 scale)
    unrotated = ref.hadamard(back[2], 64)  # H H = I
    assert np.abs(unrotated - k[:16]).max() <= np.abs(k[:16]).max() / 127


def test_a_head_size_64_does_not_divide_is_stored_unrotated() -> None:
    """kv_rotation: llama.cpp rotates heads whose size 64 divides; others are stored as quantized."""
    d = 96
    k = np.random.default_rng(3).standard_normal((16, 1, d)).astype(np.float32)
    k[3, 0, :32] = 0.0
    pool = [np.zeros((1, BS, 1, row_width("q8_0", d)), np.int8) for _ in range(2)]
    layers.store_kv_rows(*pool, k, k, np.arange(16, dtype=np.int64))
    assert pool[0].tobytes() == quantize_q8_0(k.reshape(-1, 32)).tobytes() == pool[1].tobytes()
    zero = pool[0][0, 3, 0, :34].view(BLOCK_Q8_0)[0]
    assert zero["d"] == 0 and not zero["qs"].any()


@pytest.mark.parametrize("n", [64, 128, 256])
def test_the_rotation_is_ggml_fwht_an_orthonormal_hadamard_matrix(n: int) -> None:
    """fwht (Numba) and reference.hadamard (NumPy) give the same bits; both are x times Sylvester's
    H_n / sqrt(n) on each chunk; applied twice they give x back; sizes as llama.cpp picks them."""
    x = (np.random.default_rng(n).standard_normal(2 * n) * 10).astype(np.float32)
    x[3] = 300.0  # an outlier, spread over its chunk
    got = x.copy()
    kv_rotation.fwht(got, n)
    assert np.array_equal(got, ref.hadamard(x, n))
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    want = (x.reshape(2, n).astype(np.float64) @ h.T / np.sqrt(n)).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(got[:n]).max() < 300 / np.sqrt(n) + 4 * np.sqrt(n)  # the outlier spread out
    np.testing.assert_allclose(ref.hadamard(got, n), x, rtol=1e-5, atol=1e-4)
    sizes = [
        (d, kv_rotation.key_rotation(d), kv_rotation.value_rotation(d)) for d in (32, 64, 96, 128, 192, 256)
    ]
    assert sizes == [(32, 0, 0), (64, 64, 64), (96, 0, 0), (128, 128, 64), (192, 64, 64), (256, 256, 64)]


@pytest.mark.parametrize("window", [0, 7])
def test_attention_over_q8_0_matches_its_numpy_twin_and_nearly_f32_attention(window: int) -> None:
    """Scores are llama.cpp's integer dots against a q8_0-rounded query (the twin does the same in
    NumPy), values are dequantized as the twin's: serial and parallel give the same bits, the twin the
    same up to float order, and f32 attention over the dequantized cache differs only by the query's
    rounding."""
    k, v = _rows(1)
    q = np.random.default_rng(2).standard_normal((40, 4, D)).astype(np.float32)
    tables = np.array([[2, 0, 1]], np.int64)
    pool = _q8_pool()
    layers.store_kv_rows(*pool, k, v, _slots(tables, 40))
    floats = [np.ascontiguousarray(ref.hadamard(ref.from_storage(c, D), D)) for c in pool]  # unrotated
    qsl, ctx = np.array([0, 40], np.int64), np.array([40], np.int64)
    outs = [np.empty_like(q) for _ in range(3)]
    attention.paged_attention_serial(q, *pool, qsl, ctx, tables, 0.125, window, 0.0, outs[0])
    attention.paged_attention_serial(q, *floats, qsl, ctx, tables, 0.125, window, 0.0, outs[1])
    attention.paged_attention_par(q, *pool, qsl, ctx, tables, 0.125, window, 0.0, outs[2], 2)
    np.testing.assert_array_equal(outs[0], outs[2])
    twin = ref.paged_attention(q, *pool, qsl, ctx, tables, 0.125, window)
    np.testing.assert_allclose(outs[0], twin, rtol=1e-4, atol=1e-4 * np.abs(twin).max())
    assert not np.array_equal(outs[0], outs[1])  # the query is rounded: not f32 attention's bits ...
    assert np.abs(outs[0] - outs[1]).max() < 0.1 * np.abs(outs[1]).max()  # ... but close to them


def test_the_query_is_quantized_as_ggml_avx2_quantize_row_q8_0() -> None:
    """d = max|x| / 127 rounded to f16, quants rint(x * 127 / max|x|) with ties to even (1.5 -> 2,
    2.5 -> 2), an all-zero block all zeros; the kernel and the twin agree bit for bit."""
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32) * 3
    x[1, :32] = 0.0
    x[2, :32] = np.float32(0.0)
    x[2, 0], x[2, 1], x[2, 2] = 127.0, 1.5, 2.5  # max 127: x * 127 / 127 = x exactly
    qq, qd = np.empty((3, 64), np.int8), np.empty((3, 2), np.float32)
    for r in range(3):
        attention_q8.quantize_query(x[r], qq[r], qd[r])
    quants, scales = ref.quantize_query_q8(x)
    np.testing.assert_array_equal(qq, quants.reshape(3, 64))
    np.testing.assert_array_equal(qd, scales)
    assert qq[2, :3].tolist() == [127, 2, 2] and qd[2, 0] == 1.0 and not qq[1, :32].any()
    err = np.abs(quants.astype(np.float32) * scales[..., None] - x.reshape(3, 2, 32))
    assert (err <= 0.51 * scales[..., None] + 1e-6).all()


def test_the_row_dot_and_block_scale_intrinsics_are_exact() -> None:
    """q8_dot_row over 3 blocks at an unaligned offset, with scale products 1, 2 or 4 (integer sums
    below 2**24: every float step exact), extremes (-128 * -128) included, equals the exact sum;
    scale_i8x32 equals d * q in float32."""
    rng = np.random.default_rng(6)
    keys = rng.integers(-128, 128, (2, 3 * 34 + 5), dtype=np.int8)
    qq = rng.integers(-127, 128, (2, 96), dtype=np.int8)
    keys[1, 7:39], qq[1, :32] = -128, -127
    qd = np.array([[2.0, 1.0, 2.0], [4.0, 2.0, 1.0]], np.float32)  # d_key * d_query: 1, 2 or 4
    for kr in (0, 1):
        raw = keys[kr, 5:].copy().view(np.uint8)
        for b, e in enumerate((0.5, 1.0, 2.0)):  # the f16 key scales, little-endian bytes
            raw[b * 34 : b * 34 + 2] = np.frombuffer(np.float16(e).tobytes(), np.uint8)
        keys[kr, 5:] = raw.view(np.int8)
        for row in (0, 1):
            blocks = keys[kr, 5:].reshape(3, 34)
            dk = blocks[:, :2].copy().view(np.float16).astype(np.float64)[:, 0]
            dots = (blocks[:, 2:].astype(np.int64) * qq[row].reshape(3, 32)).sum(axis=1)
            exact = (dk * qd[row] * dots).sum()
            assert row_dot(keys, kr * keys.shape[1] + 5, qq, qd)[row] == np.float32(exact)
    keys[0, 5:] = rng.integers(-127, 128, 102, dtype=np.int8)
    for b in range(3):  # random finite f16 key scales
        keys[0, 5 + b * 34 : 7 + b * 34] = np.float16(rng.uniform(0.001, 2)).reshape(1).view(np.int8)
    qd = rng.uniform(0.001, 2, (2, 3)).astype(np.float32)
    for kr in (0, 1):  # the AVX2 path (where present) and plain IR: same bits
        args = (keys, kr * keys.shape[1] + 5, qq, qd)
        np.testing.assert_array_equal(row_dot(*args), row_dot(*args, portable=True))
    out = np.zeros(70, np.float32)
    scale_kernel(keys[0], 9, np.float32(0.37), out, 5)
    np.testing.assert_array_equal(out[5:37], np.float32(0.37) * keys[0, 9:41].astype(np.float32))
    assert not out[:5].any() and not out[37:].any()


def row_dot(keys, k0, qq, qd, portable: bool = False) -> np.ndarray:
    """Every query row's score against the key row at flat byte k0."""
    blocks = keys.reshape(-1)[k0 : k0 + qd.shape[1] * 34].reshape(-1, 34)
    kd = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)  # the caller converts them
    return (rows_dot_portable if portable else rows_dot)(keys, k0, kd, qq, qd)


@njit(cache=True)
def rows_dot(keys, k0, kd, qq, qd):
    out = np.empty(qq.shape[0], np.float32)
    for r in range(qq.shape[0]):
        out[r] = simd_i8.q8_dot_row(keys, k0, kd, qq, r * qq.shape[1], qd, r * qd.shape[1])
    return out


@njit(cache=True)
def rows_dot_portable(keys, k0, kd, qq, qd):
    out = np.empty(qq.shape[0], np.float32)
    for r in range(qq.shape[0]):
        out[r] = simd_i8.q8_dot_row_portable(keys, k0, kd, qq, r * qq.shape[1], qd, r * qd.shape[1])
    return out


@njit(cache=True)
def scale_kernel(a, ia, d, out, io):
    simd_i8.scale_i8x32(a, ia, d, out, io)


def test_keys_and_values_may_differ_in_type() -> None:
    """-ctk q8_0 -ctv f16 (llama.cpp allows any pair): each cache is read in its own type."""
    k, v = _rows(3, 20)
    q = np.random.default_rng(4).standard_normal((20, 4, D)).astype(np.float32)
    tables = np.array([[1, 0]], np.int64)
    kc, vc = np.zeros((2, BS, KVH, WIDTH), np.int8), np.zeros((2, BS, KVH, D), np.uint16)
    layers.store_kv_rows(kc, vc, k, v, _slots(tables, 20))
    qsl, ctx = np.array([0, 20], np.int64), np.array([20], np.int64)
    out = np.empty_like(q)
    attention.paged_attention_serial(q, kc, vc, qsl, ctx, tables, 0.125, 0, 0.0, out)
    twin = ref.paged_attention(q, kc, vc.view(np.float16), qsl, ctx, tables, 0.125)
    np.testing.assert_allclose(out, twin, rtol=1e-4, atol=1e-4 * np.abs(twin).max())


def test_bounds_know_q8_0_rows() -> None:
    pool = _q8_pool(2)
    kv = np.zeros((1, KVH, D), np.float32)
    slots = np.zeros(1, np.int64)
    bounds.check_kv_write((kv.shape, kv.shape), tuple(pool), slots, slots)
    with pytest.raises(bounds.KernelBoundsError, match="do not fit"):  # f32 rows of D into q8_0 rows
        bounds.check_kv_write((kv.shape, kv.shape), (pool[0], np.zeros((2, BS, KVH, WIDTH), np.float32)),
                              slots, slots)  # fmt: skip
    odd = np.zeros((1, KVH, 48), np.float32)
    with pytest.raises(bounds.KernelBoundsError, match="divisible by 32"):
        bounds.check_kv_write((odd.shape, odd.shape), tuple(pool), slots, slots)
    tables, one = np.zeros((1, 1), np.int64), np.array([0, 1], np.int64)
    bounds.check_attention((1, 4, D), tuple(pool), one, one[1:], tables)
    with pytest.raises(bounds.KernelBoundsError, match="head size"):
        bounds.check_attention((1, 4, 32), tuple(pool), one, one[1:], tables)
