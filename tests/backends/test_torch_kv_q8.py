"""The torch back end's q8_0 KV rows (torch_backend/kv_q8.py) are ggml's Q8_0 blocks byte for byte, as
the NumPy reference stores them, and read back to the same values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from localllm.backends.torch_backend.kv_q8 import dequantize_rows, quantize_rows  # noqa: E402
from localllm.kernels.reference import from_storage, to_storage  # noqa: E402


def test_q8_0_rows_match_the_reference_bytes_and_values() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 3, 64)) * rng.uniform(1e-3, 30, (7, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, every q 0
    x[1, 2, :32] = np.arange(32) - 15.5  # evenly spread values, ties included after scaling or not
    raw = to_storage(x, np.int8)
    got = quantize_rows(torch.from_numpy(x)).numpy()
    assert got.dtype == np.int8 and np.array_equal(got, raw)
    assert np.array_equal(dequantize_rows(torch.from_numpy(raw)).numpy(), from_storage(raw, 64))


def test_the_query_is_rounded_as_llama_cpp_rounds_it() -> None:
    """Against a q8_0 K cache the query is scored as ggml's Q8_0 (kernels/reference.quantize_query_q8)."""
    from localllm.backends.torch_backend.kv_q8 import rounded_query
    from localllm.kernels.reference import quantize_query_q8

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 64)) * rng.uniform(1e-3, 30, (6, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.arange(32) - 15.5
    quants, scales = quantize_query_q8(x)
    want = (quants.astype(np.float32) * scales[..., None]).reshape(x.shape)
    assert np.array_equal(rounded_query(torch.from_numpy(x)).numpy(), want)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_the_hadamard_rotation_is_the_kernels_bit_for_bit(n: int) -> None:
    """kv_q8.hadamard does kernels/kv_rotation.fwht's float32 operations in its order."""
    from localllm.backends.torch_backend.kv_q8 import hadamard
    from localllm.kernels.kv_rotation import fwht

    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, 2 * n)) * 7).astype(np.float32)
    want = x.copy()
    for row in want:
        fwht(row, n)
    assert np.array_equal(hadamard(torch.from_numpy(x), n).numpy(), want)
    assert np.array_equal(hadamard(torch.from_numpy(x), 0).numpy(), x)  # no rotation


def test_rotation_sizes_are_the_kernels() -> None:
    from localllm.backends.torch_backend import kv_q8
    from localllm.kernels import kv_rotation

    for head_dim in (32, 48, 64, 80, 96, 128, 192, 256, 512):
        assert kv_q8.key_rotation(head_dim) == kv_rotation.key_rotation(head_dim)
        assert kv_q8.value_rotation(head_dim) == kv_rotation.value_rotation(head_dim)
