"""GGUF loading on the tiny fixture: hyper-parameters, quantized tensors kept as is, clear errors."""

from __future__ import annotations

import os
import pickle
import time

import gguf
import numpy as np
import pytest
from tiny_model import write_tiny_model

from localllm.backends.numpy_ref import NumpyBackend
from localllm.errors import ModelFormatError
from localllm.loading.file import GGUFFile
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


# ---------------------------------------------------------------- validation (issue 13)


def _patch(src, dst, kv=None, tensors=None, header=None):
    """Copy a GGUF, overwriting fields in place: kv {key: value}, tensors {name: {"dims"|"type"|
    "offset": value}}, header {"version"|"tensor_count"|"kv_count": value}. Sizes stay the same."""
    reader = gguf.GGUFReader(src)
    data = bytearray(src.read_bytes())
    base = reader.data.ctypes.data

    def put(part, values):
        at = part.ctypes.data - base
        data[at : at + part.nbytes] = np.asarray(values).astype(part.dtype).tobytes()

    for key, value in (kv or {}).items():
        field = reader.fields[key]
        put(field.parts[4] if field.types[0] == gguf.GGUFValueType.ARRAY else field.parts[-1], [value])
    parts = {t.name: t.field.parts for t in reader.tensors}
    for name, changes in (tensors or {}).items():
        for what, value in changes.items():
            put(parts[name][{"dims": 3, "type": 4, "offset": 5}[what]], value)
    for what, value in (header or {}).items():
        put(reader.fields[f"GGUF.{what}"].parts[0], [value])
    dst.write_bytes(bytes(data))
    return dst


def _load(path):
    return load_model(GGUFFile.open(path), NumpyBackend())


def _one_line_error(call, match):
    with pytest.raises(ModelFormatError, match=match) as err:
        call()
    assert "\n" not in str(err.value) and "\x1b" not in str(err.value)
    return str(err.value)


def test_same_bytes_other_shape(tiny_model_path, tmp_path):
    """The issue's heap corruption: attn_q declared 32x128 (numpy order) instead of 64x64, same bytes."""
    path = _patch(tiny_model_path, tmp_path / "q.gguf", tensors={"blk.0.attn_q.weight": {"dims": [128, 32]}})
    message = _one_line_error(lambda: _load(path), r"'blk\.0\.attn_q\.weight' has shape \[32, 128\]")
    assert "n_heads*head_dim=64, dim=64" in message


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (
            "llama.attention.head_count",
            8,
            "rope dimension count is 16; expected an even number, 0 to head dim 8",
        ),
        ("llama.attention.head_count", 3, r"KV head count \(2\) does not divide the head count \(3\)"),
        (
            "llama.attention.head_count_kv",
            1,
            r"attn_k\.weight' has shape \[32, 64\].*n_kv_heads\*head_dim=16",
        ),
        ("llama.attention.head_count", 0, "head_count' is 0; expected an integer from 1"),
        ("llama.attention.head_count", 2**31, "head_count' is 2147483648"),
        ("llama.attention.head_count_kv", 3, "KV head count .3. does not divide the head count .4."),
        ("llama.embedding_length", 0, "embedding_length' is 0"),
        (
            "llama.feed_forward_length",
            64,
            r"ffn_gate\.weight' has shape \[128, 64\]; .*\[ffn_dim=64, dim=64\]",
        ),
        ("llama.block_count", 1, r"'blk\.1\..*' belongs to layer 1, but block_count says 1 layers"),
        ("llama.feed_forward_length", 2**32 - 1, "feed_forward_length' is 4294967295"),
        ("llama.rope.dimension_count", 17, "rope dimension count is 17"),
        ("llama.rope.dimension_count", 64, "rope dimension count is 64"),
        ("llama.context_length", 0, "context_length' is 0"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), "layer_norm_rms_epsilon' is nan"),
        ("llama.rope.freq_base", -1.0, r"freq_base' is -1\.0"),
        ("llama.vocab_size", 100, r"tokenizer has 269 tokens|token_embd\.weight' has shape"),
    ],
)
def test_inconsistent_hyperparameters(tiny_model_path, tmp_path, key, value, match):
    path = _patch(tiny_model_path, tmp_path / "h.gguf", kv={key: value})
    _one_line_error(lambda: _load(path), match)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"version": 1}, "GGUF version 1 is not supported"),
        ({"version": 3 << 24}, "big-endian"),
        ({"tensor_count": 2**40}, "tensor count 1,099,511,627,776 is more than the file can hold"),
        ({"kv_count": 2**40}, "metadata key count is 1,099,511,627,776"),
    ],
)
def test_absurd_header_counts(tiny_model_path, tmp_path, header, match):
    path = _patch(tiny_model_path, tmp_path / "c.gguf", header=header)
    _one_line_error(lambda: GGUFFile.open(path), match)


def test_huge_array_length_fails_fast(tiny_model_path, tmp_path):
    """A 2^40-entry vocabulary used to hang info/run/serve while memory climbed past 1.8 GB."""
    path = _patch(tiny_model_path, tmp_path / "a.gguf", kv={"tokenizer.ggml.tokens": 2**40})
    start = time.perf_counter()
    _one_line_error(lambda: GGUFFile.open(path), "length of 'tokenizer.ggml.tokens' is 1,099,511,627,776")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dims": [64, 0]}, r"shape \[0, 64\]; every dimension must be >= 1"),
        ({"dims": [48, 64]}, "rows of 48 values; its type Q8_0 stores rows in blocks of 32"),
        ({"dims": [2**62, 2**62]}, "truncated: tensor 'blk.0.attn_q.weight' ends at byte"),
        ({"type": 99}, "unknown ggml type 99"),
        ({"offset": 1}, "expected a multiple of 32"),
        ({"offset": 0}, "overlap"),
    ],
)
def test_bad_tensor_records(tiny_model_path, tmp_path, changes, match):
    path = _patch(tiny_model_path, tmp_path / "t.gguf", tensors={"blk.0.attn_q.weight": changes})
    _one_line_error(lambda: GGUFFile.open(path), match)


def test_invalid_utf8_string(tiny_model_path, tmp_path):
    data = bytearray(tiny_model_path.read_bytes())
    at = data.index(b"<|im_start|>")  # a token; its first byte made an invalid UTF-8 start byte
    data[at] = 0xFF
    path = tmp_path / "u.gguf"
    path.write_bytes(bytes(data))
    _one_line_error(lambda: GGUFFile.open(path), "string 1 of 'tokenizer.ggml.tokens' is not valid UTF-8")


def test_tampered_file_is_revalidated_despite_the_cached_index(tiny_model_path, tmp_path):
    """Same size, same mtime, different header: the cached index is not trusted."""
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_model_path.read_bytes())
    GGUFFile.open(path, tmp_path / "index")
    stat = path.stat()
    _patch(path, path, kv={"llama.attention.head_count": 0})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _one_line_error(lambda: GGUFFile.open(path, tmp_path / "index"), "head_count' is 0")


def test_damaged_index_cache_is_rebuilt(tiny_model_path, tmp_path):
    GGUFFile.open(tiny_model_path, tmp_path)
    for cached in tmp_path.glob("*.pkl"):
        cached.write_bytes(b"not a pickle")
    assert GGUFFile.open(tiny_model_path, tmp_path).arch_get("block_count") == 2


class _Planted:
    """Unpickles by calling os.system: what a planted cache file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_index_cache_runs_nothing(tiny_model_path, tmp_path):
    """A cache file naming a callable outside the index's classes is refused, not called."""
    GGUFFile.open(tiny_model_path, tmp_path)
    marker = tmp_path / "ran"
    for cached in tmp_path.glob("*.pkl"):
        cached.write_bytes(pickle.dumps(_Planted(marker)))
    assert GGUFFile.open(tiny_model_path, tmp_path).arch_get("block_count") == 2
    assert not marker.exists()


def test_info_shows_escape_sequences_inert(tmp_path):
    """Metadata strings reach the terminal with control characters as visible escapes."""
    from typer.testing import CliRunner

    from localllm.cli import info as _info  # noqa: F401  (registers the command)
    from localllm.cli.app import app

    hostile = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202etxt"
    path = write_tiny_model(tmp_path / "e.gguf", extra_metadata={"general.name": hostile})
    for args in ([str(path)], [str(path), "--json"]):
        result = CliRunner().invoke(app, ["info", *args], env={"LOCALLLM_HOME": str(tmp_path / "home")})
        assert result.exit_code == 0, result.output
        assert not any(c in result.output for c in "\x1b\x07\x9b\u202e")
        assert "evil" in result.output and "pwned" in result.output


def _file_resident_kib(path) -> int:
    """Rss of this process's mappings of the file `path` (/proc/self/smaps)."""
    rss, inside, target = 0, False, str(path.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                inside = len(fields) > 5 and fields[5] == target
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1])
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_loaded_model_does_not_keep_the_files_pages(tiny_model_path, tmp_path):
    """Packing reads every matrix of the file; once the packed copies exist, the file's pages are let
    go (else a first run holds the weights twice), and the model still computes from its copies."""
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine, score_tokens

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_model_path.read_bytes())
    engine = LLMEngine(EngineConfig(model=str(path), threads=1, kv_cache_mb=1, index_dir=tmp_path / "ix"))
    assert _file_resident_kib(path) <= 8  # (all 104 KiB before)
    assert np.isfinite(np.asarray(score_tokens(engine, list(range(5, 20))))).all()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_packing_a_matrix_lets_go_of_its_file_pages_at_once(tiny_model_path, tmp_path):
    """A first run packs matrix after matrix: each one's file pages go as soon as its packed copy
    exists, so the load never holds the file and all of its copies at once (a 4B model's first run
    peaked at twice its size).  The packed copy is the same bytes."""
    from localllm.backends.weight_cache import WeightCache
    from localllm.kernels.packing import pack_weight

    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_model_path.read_bytes())
    gf = GGUFFile.open(path, tmp_path / "ix")
    name, info = max(((n, i) for n, i in gf.tensors.items() if len(i.shape) == 2), key=lambda t: t[1].nbytes)
    raw = gf.raw(name)
    want = pack_weight(np.array(raw), info.ggml_type)  # reads (maps) the matrix's pages
    before = _file_resident_kib(path)
    packed = WeightCache(gf, tmp_path / "ix").pack(raw, info.ggml_type)
    assert before >= info.nbytes // 1024 > 8
    assert _file_resident_kib(path) <= before - info.nbytes // 1024 + 8
    np.testing.assert_array_equal(np.asarray(packed.buf), np.asarray(want.buf))
