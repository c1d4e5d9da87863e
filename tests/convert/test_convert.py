"""`localllm convert`: Hugging Face checkpoint directories made from tiny GGUFs (export_hf, the inverse
mapping) convert back to the same tensors, the same vocabulary and tokenization and the same logits;
bad input is one clear error and never leaves a file under the output name."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from tiny_arch import write_arch_model
from tiny_spm import tiny_metadata
from typer.testing import CliRunner

from localllm.cli import convert as _convert  # noqa: F401  (registers the command)
from localllm.cli.app import app
from localllm.config import EngineConfig
from localllm.convert.checkpoint import TensorRef, list_tensors, load_tensor
from localllm.convert.convert_hf import convert_hf
from localllm.convert.export_hf import export_hf, gguf_metadata
from localllm.convert.names import permute_qk, unpermute_qk
from localllm.convert.spm_proto import read_spm, write_spm
from localllm.convert.vocab import load_vocab, pre_name, write_tokenizer_files
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import LocalLLMError
from localllm.loading.file import GGUFFile
from localllm.tokenizer import load_tokenizer

TEXT = "The wheel had not turned in years; then 1234 hens ran <|im_start|>past the mill.\n\n  Héllo!"
# metadata a conversion cannot know (the file's provenance) or writes as llama.cpp's convert does
PROVENANCE = ("general.name", "general.file_type", "general.quantization_version")
ADDED = (*PROVENANCE, "tokenizer.ggml.add_eos_token", "llama.vocab_size", "llama.rope.dimension_count")


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(path)


def _round_trip(tmp_path, arch: str, shard_bytes: int = 0):
    src = write_arch_model(
        tmp_path / f"{arch}.gguf", arch, "Q8_0", n_layers=2, window=16 if arch == "gemma3" else 0
    )
    hf = export_hf(src, tmp_path / f"{arch}-hf", shard_bytes=shard_bytes)
    out = tmp_path / f"{arch}-back.gguf"
    convert_hf(hf, out, "Q8_0")
    return src, hf, out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_round_trip_same_tensors_vocabulary_and_logits(tmp_path, arch: str) -> None:
    src, hf, out = _round_trip(tmp_path, arch, shard_bytes=60_000 if arch == "llama" else 0)
    a, b = _reader(src), _reader(out)
    ma, mb = gguf_metadata(a), gguf_metadata(b)
    assert {k: v for k, v in ma.items() if k not in PROVENANCE} == {
        k: v for k, v in mb.items() if k not in PROVENANCE and k in ma
    }
    assert mb["general.file_type"] == 7 and set(mb) - set(ma) <= set(ADDED)
    tb = {t.name: t for t in b.tensors}
    assert sorted(tb) == sorted(t.name for t in a.tensors)
    for t in a.tensors:  # Q8_0 blocks of Q8_0-dequantized values come out byte for byte the same
        assert t.tensor_type == tb[t.name].tensor_type and np.array_equal(t.data, tb[t.name].data), t.name
    tok_a, tok_b = (load_tokenizer(GGUFFile.open(p).metadata) for p in (src, out))
    for special in (False, True):
        assert tok_a.encode(TEXT, parse_special=special) == tok_b.encode(TEXT, parse_special=special)
    logits = [score_tokens(LLMEngine(EngineConfig(model=str(p), threads=1, ctx_size=64)), list(range(3, 40)))
              for p in (src, out)]  # fmt: skip
    np.testing.assert_array_equal(logits[0], logits[1])


def test_hugging_face_layout(tmp_path) -> None:
    """Hugging Face's q/k rows are in rotate-half order (llama.cpp's permute undone); Gemma's norms are
    w where GGUF stores 1 + w; shards come with an index naming each tensor's file."""
    src, hf, _ = _round_trip(tmp_path, "llama", shard_bytes=60_000)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    refs = {r.name: r for r in list_tensors(sorted(hf.glob("*.safetensors")))}
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(refs)
    from localllm.quant import dequantize

    q = next(t for t in _reader(src).tensors if t.name == "blk.0.attn_q.weight")
    gguf_q = dequantize(q.data, q.tensor_type)
    hf_q = load_tensor(refs["model.layers.0.self_attn.q_proj.weight"])
    assert not np.array_equal(hf_q, gguf_q) and np.array_equal(permute_qk(hf_q, 4), gguf_q)
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    assert np.array_equal(unpermute_qk(permute_qk(rows, 2), 2), rows)
    assert permute_qk(rows, 2)[:, 0].tolist()[:8] == [0, 12, 3, 15, 6, 18, 9, 21]  # halves interleaved
    gemma_src = write_arch_model(tmp_path / "g.gguf", "gemma3", "F32", n_layers=1)
    gemma_hf = export_hf(gemma_src, tmp_path / "g-hf")
    norm = next(t for t in _reader(gemma_src).tensors if t.name == "blk.0.attn_q_norm.weight")
    name = "model.layers.0.self_attn.q_norm.weight"
    exported = load_tensor(TensorRef(name, gemma_hf / "model.safetensors", "F32", (16,)))
    np.testing.assert_allclose(exported, np.asarray(norm.data) - 1, rtol=0, atol=1e-7)
    config = json.loads((gemma_hf / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["head_dim"] == 16


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path) -> None:
    _, hf, _ = _round_trip(tmp_path, "llama")
    config = json.loads((hf / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    config["rope_theta"] = 10000.0
    (hf / "config.json").write_text(json.dumps(config))
    out = tmp_path / "llama3.gguf"
    convert_hf(hf, out, "Q8_0")
    freqs = next(t for t in _reader(out).tensors if t.name == "rope_freqs.weight")
    # head_dim 16: wavelengths 2*pi*10000**(2i/16); under 8192/4 -> 1, over 8192 -> 8, between blended
    smooth = (8192 / (2 * np.pi * 1000.0) - 1) / 3
    expected = [1, 1, 1, 1, 1, 1, 1 / ((1 - smooth) / 8 + smooth), 8]
    np.testing.assert_allclose(np.asarray(freqs.data), expected, rtol=1e-5)
    assert "llama.rope.scaling.type" not in gguf_metadata(_reader(out))
    engine = LLMEngine(EngineConfig(model=str(out), threads=1, ctx_size=64))
    assert np.isfinite(score_tokens(engine, list(range(3, 20)))).all()


def test_bf16_tensors_are_read_exactly(tmp_path) -> None:
    values = np.array([[1.0, -2.5], [0.15625, 3e38]], dtype=np.float32)
    words = (values.view(np.uint32) >> 16).astype("<u2")
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + words.tobytes())
    (ref,) = list_tensors([path])
    assert ref.dtype == "BF16" and np.array_equal(
        load_tensor(ref), (words.astype(np.uint32) << 16).view(np.float32)
    )


def test_sentencepiece_vocabulary_round_trip(tmp_path) -> None:
    meta = tiny_metadata(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.unknown_token_id": 0})
    meta["tokenizer.ggml.scores"] = [float(np.float32(s)) for s in meta["tokenizer.ggml.scores"]]
    ids = write_tokenizer_files(meta, tmp_path)
    assert ids == {"bos": 1, "eos": 2, "unk": 0}
    spm = read_spm((tmp_path / "tokenizer.model").read_bytes())
    assert read_spm(write_spm(spm)) == spm and spm.pieces == meta["tokenizer.ggml.tokens"]
    vocab = load_vocab(tmp_path, len(spm.pieces) + 3)  # config.json's vocab_size may exceed the model's
    assert vocab.model == "llama" and vocab.tokens[: len(spm.pieces)] == meta["tokenizer.ggml.tokens"]
    assert vocab.tokens[-1] == f"[PAD{len(spm.pieces) + 2}]" and vocab.types[-3:] == [5, 5, 5]
    assert (
        vocab.scores[: len(spm.pieces)] == meta["tokenizer.ggml.scores"] and vocab.add_space_prefix is False
    )
    assert vocab.types[: len(spm.pieces)] == meta["tokenizer.ggml.token_type"]


def test_pre_tokenizer_names() -> None:
    from localllm.convert.vocab import PRE_TOKENIZERS

    for name, pre in PRE_TOKENIZERS.items():
        assert pre_name(json.loads(json.dumps(pre))) == name
    with pytest.raises(LocalLLMError, match="pre-tokenizer .* is not one localllm convert knows"):
        pre_name({"type": "Whitespace"})


def test_bad_input_is_one_clear_error(tmp_path) -> None:
    src, hf, out = _round_trip(tmp_path, "qwen2")
    with pytest.raises(LocalLLMError, match="exists; pass --force"):
        convert_hf(hf, out)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(
        LocalLLMError, match="architecture MambaForCausalLM is not one localllm convert can map"
    ):
        convert_hf(hf, tmp_path / "x.gguf")
    (hf / "config.json").write_text(json.dumps(config))
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(LocalLLMError, match="model.safetensors is not a readable safetensors file"):
        convert_hf(hf, tmp_path / "x.gguf")
    with pytest.raises(LocalLLMError, match="no config.json"):
        convert_hf(tmp_path, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch) -> None:
    _, hf, out = _round_trip(tmp_path, "gemma3")
    import localllm.convert.convert_hf as module

    calls = []

    def failing(ref):
        calls.append(ref.name)
        if len(calls) > 3:
            raise LocalLLMError("disk full")
        return load_tensor(ref)

    monkeypatch.setattr(module, "load_tensor", failing)
    before = out.read_bytes()
    with pytest.raises(LocalLLMError, match="disk full"):
        convert_hf(hf, out, force=True)
    assert out.read_bytes() == before and not list(tmp_path.glob(".*.part"))


def test_cli(tmp_path) -> None:
    src = write_arch_model(tmp_path / "m.gguf", "qwen2", "F32", n_layers=1)
    hf = export_hf(src, tmp_path / "hf")
    result = CliRunner().invoke(app, ["convert", str(hf), str(tmp_path / "o.gguf"), "--type", "q8_0"])
    assert result.exit_code == 0, result.output
    assert "o.gguf: qwen2, Q8_0" in result.stdout and "Q8_0" in result.stdout
    again = CliRunner().invoke(app, ["convert", str(hf), str(tmp_path / "o.gguf")])
    assert again.exit_code != 0 and "exists; pass --force" in str(again.exception)
    bad_type = CliRunner().invoke(app, ["convert", str(hf), str(tmp_path / "p.gguf"), "--type", "Q3_X"])
    assert "unknown quantization type 'Q3_X'" in str(bad_type.exception)
