"""Our NumPy dequantizers must match gguf.quants.dequantize bit for bit, for every supported type."""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from localllm.errors import ModelFormatError
from localllm.quant import (
    QUANT_BY_NAME,
    QUANT_TYPES,
    QuantType,
    dequantize,
    is_supported,
    row_bytes,
    type_name,
)
from localllm.quant.ggml import BLOCK_KERNELS

T = gguf.GGMLQuantizationType
BLOCK_TYPES = list(BLOCK_KERNELS)  # every quantized (block) type we implement
# Types gguf can quantize, so we can also feed realistic (not just random) blocks.
GGUF_QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"]


def assert_bits_equal(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == expected.shape
    assert not np.isnan(expected).any()
    expected_bits = np.asarray(expected, dtype=np.float32).view(np.uint32)
    np.testing.assert_array_equal(ours.view(np.uint32), expected_bits)


def random_blocks(rng: np.random.Generator, name: str, n_rows: int, blocks_per_row: int) -> np.ndarray:
    """Random block bytes whose fp16 scale fields hold finite values (so no NaN/inf in the output)."""
    layout = BLOCK_KERNELS[name][0]
    raw = rng.integers(0, 256, size=(n_rows, blocks_per_row * layout.itemsize), dtype=np.uint8)
    blocks = raw.view(layout)
    for field in layout.names:
        if layout[field] == np.dtype("<f2"):
            blocks[field] = (rng.standard_normal(blocks[field].shape) * 0.05).astype(np.float16)
    return raw


def compare(raw: np.ndarray, name: str) -> None:
    assert_bits_equal(dequantize(raw, T[name]), gguf_dequantize(raw, T[name]))


def test_type_table_matches_gguf() -> None:
    for ggml_type, qt in QUANT_TYPES.items():
        assert isinstance(qt, QuantType)
        assert T[qt.name] == ggml_type
        assert gguf.GGML_QUANT_SIZES[T[qt.name]] == (qt.block_size, qt.type_size)
    for name, (layout, block_size, _) in BLOCK_KERNELS.items():
        assert gguf.GGML_QUANT_SIZES[T[name]] == (block_size, layout.itemsize)
    assert set(BLOCK_KERNELS) == {qt.name for qt in QUANT_TYPES.values() if qt.block_size > 1}
    assert {name: qt.ggml_type for name, qt in QUANT_BY_NAME.items()} == {
        qt.name: t for t, qt in QUANT_TYPES.items()
    }


def test_kernels_read_the_type_table() -> None:
    """The repacker's per-kind block sizes and its integer-kernel kinds come from the one table."""
    from localllm.kernels import packing

    assert set(packing.KIND_OF_GGML) == set(QUANT_TYPES)
    for ggml_type, kind in packing.KIND_OF_GGML.items():
        qt = QUANT_TYPES[ggml_type]
        assert packing._FILE_BLOCK[kind] == gguf.GGML_QUANT_SIZES[T(ggml_type)][::-1]
        assert (kind in packing.LANE_KINDS) == qt.int_kernel, qt.name


def test_quant_type_row_bytes() -> None:
    q4_k = QUANT_BY_NAME["Q4_K"]
    assert q4_k.row_bytes(512) == 288 == row_bytes(T.Q4_K, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        q4_k.row_bytes(300)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("shape", [(7, 3), (1, 1), (2, 5, 2)], ids=["rows", "one-block", "3d"])
def test_random_blocks_match_gguf(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{name}{shape}".encode()))
    *lead, blocks_per_row = shape
    n_rows = int(np.prod(lead))
    raw = random_blocks(rng, name, n_rows, blocks_per_row)
    compare(raw.reshape(*lead, raw.shape[-1]), name)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_single_row_and_row_slices(name: str) -> None:
    rng = np.random.default_rng(1)
    raw = random_blocks(rng, name, 9, 4)
    full = dequantize(raw, T[name])
    compare(raw[3], name)  # 1-D: one row
    compare(raw[2:6], name)  # contiguous slice of rows
    compare(raw[::3], name)  # strided rows
    assert_bits_equal(dequantize(raw[3], T[name]), full[3])
    assert_bits_equal(dequantize(raw[2:6], T[name]), full[2:6])


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_chunked_path_matches(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks force many loop iterations, including a short last chunk."""
    import localllm.quant as quant

    rng = np.random.default_rng(2)
    raw = random_blocks(rng, name, 11, 2)
    expected = gguf_dequantize(raw, T[name])
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 3 * 2 * BLOCK_KERNELS[name][1])
    assert_bits_equal(dequantize(raw, T[name]), expected)


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
@pytest.mark.parametrize("shape", [(6, 128), (1, 64), (3, 2, 96)])
def test_gguf_quantized_roundtrip(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., :5] = [0.0, -0.0, 1e-8, 65504.0, -3.5]  # zeros, tiny and fp16-extreme values
    raw = gguf_quantize(x, T[name])
    expected = gguf_dequantize(raw, T[name])
    assert_bits_equal(dequantize(raw, T[name]), expected)
    assert_bits_equal(dequantize(raw[0], T[name]), expected[0])


def test_f32_is_a_view() -> None:
    x = np.random.default_rng(4).standard_normal((3, 8)).astype(np.float32)
    out = dequantize(x, T.F32)
    assert_bits_equal(out, x)
    assert np.shares_memory(out, x)
    assert_bits_equal(dequantize(x.view(np.uint8), T.F32), x)  # raw bytes are accepted too


def test_bf16_accepts_bytes_and_uint16() -> None:
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    raw = gguf_quantize(x, T.BF16)
    assert raw.dtype == np.uint8 and raw.shape == (4, 32)  # gguf (writer and reader) uses raw bytes
    expected = gguf_dequantize(raw, T.BF16)
    assert_bits_equal(dequantize(raw, T.BF16), expected)
    assert_bits_equal(dequantize(raw.view(np.uint16), T.BF16), expected)


def test_through_gguf_reader(tmp_path) -> None:
    """Tensors as GGUFReader really exposes them (memmaps; BF16 as uint8 bytes)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ["BF16", "Q5_1", "Q8_0"]:
        writer.add_tensor(name, gguf_quantize(x, T[name]), raw_dtype=T[name])
    writer.add_tensor("F16", x.astype(np.float16))
    writer.add_tensor("F32", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = gguf.GGUFReader(str(path)).tensors
    assert {t.name: t.data.dtype for t in tensors}["BF16"] == np.uint8
    for t in tensors:
        ours = dequantize(t.data, t.tensor_type)
        assert ours.shape == (5, 64)
        assert_bits_equal(ours, gguf_dequantize(t.data, t.tensor_type))
        assert_bits_equal(dequantize(t.data[1:3], t.tensor_type), ours[1:3])


def test_sizes_names_and_errors() -> None:
    assert row_bytes(T.Q4_K, 512) == 288
    assert row_bytes(T.Q8_0, 64) == 68
    assert row_bytes(T.F32, 10) == 40
    with pytest.raises(ValueError):
        row_bytes(T.Q4_0, 33)
    assert is_supported(T.Q6_K) and is_supported(int(T.BF16))
    assert not is_supported(T.IQ2_XXS) and not is_supported(99)
    assert type_name(T.Q4_K) == "Q4_K"
    assert type_name(T.IQ2_XXS) == "IQ2_XXS"
    assert type_name(99) == "type 99"
    with pytest.raises(ModelFormatError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), T.IQ2_XXS)
    with pytest.raises(ValueError):
        dequantize(np.zeros((1, 19), np.uint8), T.Q4_0)


@pytest.mark.slow
def test_real_model_tensors(request: pytest.FixtureRequest) -> None:
    try:
        path = request.getfixturevalue("smollm2_path")
    except pytest.FixtureLookupError:
        pytest.skip("smollm2_path fixture not available")
    tensors = gguf.GGUFReader(str(path)).tensors
    picked: dict[str, object] = {}
    for t in tensors:  # first tensor of each type, plus a second Q4_1 one
        key = t.tensor_type.name if t.tensor_type.name not in picked else f"{t.tensor_type.name}#2"
        picked.setdefault(key, t)
    assert {"Q4_1", "Q8_0", "F32"} <= set(picked)
    for t in picked.values():
        data = t.data if t.data.shape[0] <= 4096 else t.data[1000:1300]  # keep the embedding cheap
        assert_bits_equal(dequantize(data, t.tensor_type), gguf_dequantize(data, t.tensor_type))
        if t.data.ndim == 2:
            row = t.data[5]
            assert_bits_equal(dequantize(row, t.tensor_type), gguf_dequantize(row, t.tensor_type))
