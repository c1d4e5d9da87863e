"""GGUF loading on the tiny fixture: hyper-parameters, quantized tensors kept as is, clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_model import write_tiny_model

from localllm.backends.numpy_ref import NumpyBackend
from localllm.errors import ModelFormatError
from localllm.gguf_file import GGUFFile
from localllm.models import load_model


def test_metadata_and_tensors(tiny_model_path, index_dir):
    gf = GGUFFile.open(tiny_model_path, index_dir)
    assert gf.architecture == "llama"
    assert gf.arch_get("embedding_length") == 64
    raw = gf.raw("blk.0.attn_q.weight")
    assert raw.dtype == np.uint8 and raw.shape == (64, 64 // 32 * 34)  # Q8_0 rows stay quantized
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)


def test_index_cache_gives_the_same_file(tiny_model_path, tmp_path):
    first = GGUFFile.open(tiny_model_path, tmp_path)
    assert list(tmp_path.glob("*.pkl"))
    second = GGUFFile.open(tiny_model_path, tmp_path)
    assert first.metadata.keys() == second.metadata.keys()
    assert first.tensors == second.tensors


def test_model_args(tiny_model_path, index_dir):
    model = load_model(GGUFFile.open(tiny_model_path, index_dir), NumpyBackend())
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (64, 2, 4, 2, 16)
    assert model.output is model.tok_embd  # tied embeddings


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile.open(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        GGUFFile.open(tmp_path / "nope.gguf")


def test_truncated_file(tiny_model_path, tmp_path):
    data = tiny_model_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelFormatError, match="truncated"):
        GGUFFile.open(path)


def _rewrite(src, dst, arch=None, tensor_type=None):
    """Copy the tiny GGUF, changing the architecture or one tensor's type."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(
            name.replace("llama.", f"{arch}.") if arch else name, f.contents(), f.types[0], sub_type=sub
        )
    for t in reader.tensors:
        qtype = t.tensor_type
        if tensor_type is not None and t.name == "blk.0.attn_q.weight":
            qtype = tensor_type
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.asarray(t.data))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture(tiny_model_path, tmp_path):
    path = tmp_path / "mamba.gguf"
    _rewrite(tiny_model_path, path, arch="mamba")
    with pytest.raises(ModelFormatError, match="'mamba' architecture"):
        load_model(GGUFFile.open(path), NumpyBackend())


def test_unsupported_tensor_type(tiny_model_path, tmp_path):
    path = tmp_path / "iq.gguf"
    # IQ4_NL blocks have Q4_0's size (18 bytes per 32 values), so Q4_0 bytes can pose as IQ4_NL
    src = write_tiny_model(tmp_path / "q40.gguf", quant="Q4_0")
    _rewrite(src, path, tensor_type=gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ModelFormatError, match="IQ4_NL"):
        load_model(GGUFFile.open(path), NumpyBackend())
