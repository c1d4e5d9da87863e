"""`localllm convert` reads MXFP4 tensors as Hugging Face stores them (`<name>_blocks` / `_scales`, as
gpt-oss and transformers' Mxfp4Config write them) and writes them as GGUF MXFP4, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_arch import write_arch_model

from localllm.config import EngineConfig
from localllm.convert.checkpoint import ggml_mxfp4, list_tensors, load_tensor, tensor_files
from localllm.convert.convert_hf import convert_hf
from localllm.convert.export_hf import export_hf
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import LocalLLMError

# E2M1 as the MX spec and transformers decode it: code -> value, times 2 ** (scale - 127)
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MXFP4_ROLES = ("mlp.gate_proj", "mlp.up_proj")


def _hf_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random (blocks, scales) in Hugging Face's layout and the values they decode to."""
    codes = rng.integers(0, 16, (rows, cols // 32, 32)).astype(np.uint8)
    scales = rng.integers(120, 127, (rows, cols // 32)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2i low nibble, 2i + 1 high
    values = np.array(FP4_VALUES, np.float32)[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return blocks, scales, values.reshape(rows, cols)


@pytest.fixture
def hf_dir(tmp_path):
    """A qwen2 checkpoint whose gate and up projections are stored as MXFP4 pairs; their values."""
    from safetensors.numpy import load_file, save_file

    src = write_arch_model(tmp_path / "q.gguf", "qwen2", "F32", n_layers=2, window=0)
    hf = export_hf(src, tmp_path / "hf")
    (file,) = tensor_files(hf)
    tensors, values, rng = load_file(file), {}, np.random.default_rng(3)
    for name in [n for n in tensors if any(r in n for r in MXFP4_ROLES)]:
        rows, cols = tensors.pop(name).shape
        base = name.removesuffix(".weight")
        tensors[f"{base}_blocks"], tensors[f"{base}_scales"], values[name] = _hf_mxfp4(rng, rows, cols)
    save_file(tensors, file)
    return hf, values


def test_pairs_read_as_one_exact_tensor(hf_dir) -> None:
    hf, values = hf_dir
    refs = {r.name: r for r in list_tensors(tensor_files(hf))}
    assert not any(n.endswith(("_blocks", "_scales")) for n in refs)
    for name, want in values.items():
        assert refs[name].dtype == "MXFP4" and refs[name].shape == want.shape
        assert np.array_equal(load_tensor(refs[name]), want)


@pytest.mark.parametrize("target, stored", [("Q8_0", "MXFP4"), ("MXFP4", "MXFP4"), ("F32", "F32")])
def test_convert_keeps_them_mxfp4_bit_for_bit(tmp_path, hf_dir, target: str, stored: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    hf, values = hf_dir
    out = tmp_path / f"o-{target}.gguf"
    convert_hf(hf, out, target)
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    refs = {r.name: r for r in list_tensors(tensor_files(hf))}
    for il in range(2):
        for role, gguf_name in zip(MXFP4_ROLES, ("ffn_gate", "ffn_up"), strict=True):
            t, name = tensors[f"blk.{il}.{gguf_name}.weight"], f"model.layers.{il}.{role}.weight"
            assert t.tensor_type.name == stored
            data = np.asarray(t.data)
            if stored == "MXFP4":  # the checkpoint's blocks moved, and gguf's own decoder agrees
                assert np.array_equal(data.view(np.uint8).reshape(-1), ggml_mxfp4(refs[name]).reshape(-1))
                got = gguf_dequantize(data, t.tensor_type)
            else:
                got = data
            assert np.array_equal(got.reshape(values[name].shape), values[name])
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == ("Q8_0" if target != "F32" else "F32")
    e = LLMEngine(EngineConfig(model=str(out), backend="numba", threads=2, ctx_size=64))
    assert np.isfinite(np.asarray(score_tokens(e, [5, 9, 40, 77]))).all()


def test_a_lone_blocks_tensor_is_refused(tmp_path, hf_dir) -> None:
    from safetensors.numpy import load_file, save_file

    hf, _ = hf_dir
    (file,) = tensor_files(hf)
    tensors = load_file(file)
    tensors.pop("model.layers.0.mlp.up_proj_scales")
    save_file(tensors, file)
    with pytest.raises(LocalLLMError, match="up_proj_blocks.*no uint8 .*up_proj_scales"):
        list_tensors(tensor_files(hf))
