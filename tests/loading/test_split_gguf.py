"""Split GGUF models (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf ...) load as one model.

The split files are written here by `gguf`'s own writer (split_max_tensors), which numbers and names
shards as llama.cpp's gguf-split does (split.no, split.count, split.tensors.count; all metadata in the
first shard). The same weights split and unsplit must give the same logits bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tiny_model import write_tiny_model

from localllm.errors import ModelFormatError
from localllm.loading.file import GGUFFile
from localllm.loading.splits import split_names

PROMPT = [5, 80, 81, 200, 17, 3, 99, 42, 7, 150]


def split_gguf(src: Path, dst: Path, max_tensors: int, small_first_shard: bool = False) -> list[Path]:
    """`src` rewritten as dst-00001-of-0000N.gguf ..., at most max_tensors tensors a shard."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch, split_max_tensors=max_tensors, small_first_shard=small_first_shard)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    names = w.format_shard_names(Path(dst))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return names


def last_logits(path: Path, index_dir: Path | None = None, fuse: bool = True) -> np.ndarray:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine, score_tokens

    config = EngineConfig(model=str(path), backend="numba", threads=1, ctx_size=64, index_dir=index_dir)
    e = LLMEngine(config)
    e.backend.fuse_layers = fuse
    return np.asarray(score_tokens(e, PROMPT), np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[Path]]:
    d = tmp_path_factory.mktemp("split")
    whole = write_tiny_model(d / "tiny.gguf", n_layers=3)
    return whole, split_gguf(whole, d / "tiny-split.gguf", max_tensors=8)


def test_shards_are_named_and_numbered_as_gguf_split_does(tiny) -> None:
    whole, shards = tiny
    assert [p.name for p in shards] == [f"tiny-split-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    assert split_names(shards[2]) == shards and split_names(whole) == [whole]
    gf = GGUFFile.open(shards[0])
    assert gf.paths == shards and gf.size == sum(p.stat().st_size for p in shards)
    assert sorted({t.shard for t in gf.tensors.values()}) == [0, 1, 2, 3]
    assert gf.metadata["split.tensors.count"] == len(gf.tensors) == len(GGUFFile.open(whole).tensors)
    from localllm.model_info import summarize

    info = summarize(gf)
    assert info.extra["split files"] == 4 and info.file_size == gf.size


def test_split_and_whole_give_the_same_logits(tiny, tmp_path) -> None:
    """Bit for bit, fused and op by op; from the first shard or any other; with the index and weight
    caches cold and warm."""
    whole, shards = tiny
    for fuse in (True, False):
        expected = last_logits(whole, fuse=fuse)
        assert np.array_equal(last_logits(shards[0], fuse=fuse), expected)
    for _ in range(2):  # the second start reads the caches the first wrote
        assert np.array_equal(last_logits(shards[2], tmp_path), expected)


def test_tensors_read_from_their_shards(tiny) -> None:
    whole, shards = tiny
    one, split = GGUFFile.open(whole), GGUFFile.open(shards[-1])
    for name in one.tensors:
        assert np.array_equal(split.raw(name), one.raw(name)), name
        assert split.offset_of(split.raw(name)) is not None


def test_a_first_shard_without_tensors(tmp_path) -> None:
    """gguf-split --no-tensor-first-split: the first file holds only metadata."""
    whole = write_tiny_model(tmp_path / "t.gguf")
    shards = split_gguf(whole, tmp_path / "m.gguf", max_tensors=10, small_first_shard=True)
    gf = GGUFFile.open(shards[1])
    assert not [t for t in gf.tensors.values() if t.shard == 0] and len(gf.tensors) == 20
    assert np.array_equal(last_logits(shards[0]), last_logits(whole))


def _one_line(path: Path, match: str) -> None:
    with pytest.raises(ModelFormatError, match=match) as err:
        GGUFFile.open(path)
    assert "\n" not in str(err.value)


def test_missing_renamed_and_mixed_shards_are_one_line(tiny, tmp_path) -> None:
    _, shards = tiny
    copies = []
    for p in shards:
        copies.append(tmp_path / p.name)
        os.link(p, copies[-1])
    copies[2].unlink()
    _one_line(copies[0], r"tiny-split-00003-of-00004\.gguf is missing: .* needs all 4 of its files")
    renamed = tmp_path / "renamed.gguf"
    os.link(shards[1], renamed)
    _one_line(renamed, r"renamed\.gguf is one of 4 files of a split model, but its name")
    os.link(shards[3], copies[2])  # shard 4's file under shard 3's name
    _one_line(copies[0], r"-00003-of-00004\.gguf holds shard 4 of 4 .* not shard 3 of 4")


def test_a_tensor_count_that_does_not_add_up_is_refused(tmp_path) -> None:
    whole = write_tiny_model(tmp_path / "t.gguf")
    shards = split_gguf(whole, tmp_path / "m.gguf", max_tensors=12)
    data = bytearray(shards[0].read_bytes())
    key = b"split.tensors.count"
    at = data.index(key) + len(key) + 4  # then the value type (u32), then the i32 value
    data[at : at + 4] = (21).to_bytes(4, "little")
    shards[0].write_bytes(bytes(data))
    _one_line(shards[1], r"promises 21 tensors \(split.tensors.count\) but its 2 files hold 20")


def test_rm_and_list_treat_the_shards_as_one_model(tiny, tmp_path, monkeypatch) -> None:
    from localllm.cli import manage
    from localllm.registry import index_dir, load_registry, models_dir

    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    cache = models_dir(home)
    cache.mkdir(parents=True)
    _, shards = tiny
    for p in shards:
        os.link(p, cache / p.name)
    last_logits(cache / shards[0].name, index_dir(home))  # writes the index and weight caches
    rows = [r for r in manage.model_rows(load_registry(None), home) if r.file.startswith("tiny-split")]
    assert [(r.file, r.size) for r in rows] == [(shards[0].name, sum(p.stat().st_size for p in shards))]
    removed = [p for p, _ in manage.remove_model(shards[0].name, load_registry(None), home)]
    assert {p.name for p in removed} >= {p.name for p in shards}
    assert not list(cache.glob("tiny-split*")) and not list(index_dir(home).iterdir())


def test_a_nonsense_split_count_is_refused(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "t.gguf", extra_metadata={"split.count": "\x1b[2J"})
    _one_line(path, r"'split.count' is '\\x1b\[2J'; expected 0 to 65,535")


@pytest.mark.slow
def test_smollm2_split_gives_the_same_logits(smollm2_path: Path, tmp_path) -> None:
    """The real SmolLM2 (Q4_1, 272 tensors) in 3 files: the same logits at every position, bit for bit.
    (Split by llama.cpp's llama-gguf-split, in 5 files or with a metadata-only first file, it gives the
    same too: README, Split models.)"""
    shards = split_gguf(smollm2_path, tmp_path / "smollm2.gguf", max_tensors=100)
    assert len(shards) == 3
    assert np.array_equal(last_logits(shards[1]), last_logits(smollm2_path))
