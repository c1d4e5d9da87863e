"""MXFP4 in quant/: bit-exact dequantization and quantization against gguf's reference (ggml's
formulas), the type table, and `localllm quantize --type MXFP4_MOE` as llama-quantize chooses types."""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tiny_moe import write_moe_variant

from localllm.model_info import file_quant
from localllm.quant import QUANT_BY_NAME, dequantize, type_name
from localllm.quant.quantize_gguf import FILE_TYPES, check_target, choose_type, convert_rows, quantize_file

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32
    return a.view(np.uint32)


def test_type_table() -> None:
    qt = QUANT_BY_NAME["MXFP4"]
    assert (qt.ggml_type, qt.block_size, qt.type_size) == (39, 32, 17)
    assert gguf.GGML_QUANT_SIZES[MXFP4] == (32, 17)
    assert type_name(39) == "MXFP4" and qt.row_bytes(2880) == 90 * 17


@pytest.mark.parametrize("shape", [(9, 4), (1, 1), (3, 2, 5)])
def test_every_byte_dequantizes_like_gguf(shape: tuple[int, ...]) -> None:
    """Random bytes cover all 256 exponents (0 and 1 give subnormal scales) and all 16 codes."""
    rng = np.random.default_rng(sum(shape))
    *lead, blocks = shape
    raw = rng.integers(0, 256, (*lead, blocks * 17), dtype=np.uint8)
    raw.reshape(-1, 17)[:256, 0] = np.arange(min(256, raw.size // 17))
    with np.errstate(over="ignore"):  # exponents near 255 overflow to inf in both
        np.testing.assert_array_equal(bits(dequantize(raw, MXFP4)), bits(gguf_dequantize(raw, MXFP4)))


def _awkward_rows() -> np.ndarray:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 128)) * rng.exponential(1.0, (40, 1))).astype(np.float32)
    x[0, :32] = 0  # all zero: exponent 0
    x[1, :32] = -3.0  # ties for the largest magnitude
    x[2, :32] = np.linspace(-6, 6, 32)  # on and between the E2M1 grid
    x[3, :32] = 2.0**-130  # below the smallest normal scale
    x[4, 5], x[4, 40] = 1e-30, -1e4  # tiny and huge in one row
    x[5, :32] = 0.75  # halfway between two codes: the first wins
    return x


def test_quantizer_writes_gguf_reference_bytes() -> None:
    x = _awkward_rows()
    ours = convert_rows(x, "MXFP4")
    np.testing.assert_array_equal(ours, gguf_quantize(x, MXFP4))
    back = dequantize(ours, MXFP4)
    blocks, out = x.reshape(-1, 32), back.reshape(-1, 32)
    # each element is within half the widest grid step (2 scale units) of the block's top value
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 4
    assert (np.abs(out - blocks) <= scale + 1e-30).all()


def test_moe_mix_types_as_llama_quantize() -> None:
    assert check_target("mxfp4") == "MXFP4_MOE" and FILE_TYPES["MXFP4_MOE"] == 38
    choose = {
        ("blk.0.ffn_up_exps.weight", (8, 64, 96)): "MXFP4",
        ("blk.0.attn_q.weight", (64, 96)): "Q8_0",
        ("output.weight", (1000, 64)): "Q8_0",
        ("blk.0.ffn_gate_inp.weight", (8, 64)): "F32",
        ("blk.0.attn_norm.weight", (64,)): "F32",
        ("blk.0.ffn_up_exps.weight", (8, 64, 90)): "F32",  # rows not whole blocks
    }
    for (name, shape), expected in choose.items():
        assert choose_type(name, shape, "MXFP4_MOE", tied=False) == expected, name


def test_quantize_file_to_mxfp4_and_back(tmp_path) -> None:
    src = write_moe_variant(tmp_path / "moe-f32.gguf", "qwen3moe", "F32")
    out = tmp_path / "moe-mxfp4.gguf"
    report = quantize_file(src, out, "MXFP4")
    reader = gguf.GGUFReader(out)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    assert types["MXFP4"] == 12 and report.types["MXFP4"] == 12  # 4 layers x gate/up/down experts
    assert set(types) == {"MXFP4", "Q8_0", "F32"}
    assert file_quant({"general.file_type": 38}, []) == "MXFP4_MOE"
    original = {t.name: t for t in gguf.GGUFReader(src).tensors}
    for t in reader.tensors:
        if t.tensor_type == MXFP4:
            expected = gguf_quantize(np.asarray(original[t.name].data), MXFP4)
            np.testing.assert_array_equal(np.asarray(t.data), expected)
    back = tmp_path / "moe-f16.gguf"
    quantize_file(out, back, "F16", allow_requantize=True)
    name = "blk.1.ffn_down_exps.weight"
    mx = next(t for t in reader.tensors if t.name == name)
    f16 = next(t for t in gguf.GGUFReader(back).tensors if t.name == name)
    expected = dequantize(np.asarray(mx.data), MXFP4).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(f16.data), expected)
