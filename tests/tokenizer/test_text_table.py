"""TextTable (a vocabulary as one UTF-8 blob) and TokenIndex: the same answers as a list of str and a
dict built backwards, a real bound on their memory, and GGUF vocabularies read into them."""

from __future__ import annotations

import pickle
import random
import tracemalloc

import gguf
import pytest

from localllm.errors import ModelFormatError
from localllm.loading.file import GGUFFile
from localllm.loading.parser import TEXT_TABLE_MIN
from localllm.text_table import TextTable
from localllm.tokenizer.token_index import TokenIndex

ALPHABET = "ab▁é中\U0001f600<>|x"


def _vocab(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(ALPHABET, k=rng.randint(1, 6))) for _ in range(n)]
    return [*words, words[3], words[7], "", "tail"]  # texts listed twice, an empty one


def test_reads_like_the_list_it_was_made_from() -> None:
    texts = _vocab(3000)
    table = TextTable.from_strings(texts)
    assert len(table) == len(texts) and list(table) == texts and table == texts
    assert [table[i] for i in (0, 5, -1, -4)] == [texts[i] for i in (0, 5, -1, -4)]
    assert table[10:20] == texts[10:20] and table[::-997] == texts[::-997]
    assert table.joined(5, 40, "\x00") == "\x00" + "\x00".join(texts[5:40])
    with pytest.raises(IndexError):
        table[len(texts)]
    again = pickle.loads(pickle.dumps(table))
    assert again == table and list(again.byte_lengths()) == [len(t.encode()) for t in texts]


def test_lookups_match_a_dict_built_backwards() -> None:
    texts = _vocab(5000, seed=1)
    table = TextTable.from_strings(texts)
    first = dict(zip(reversed(texts), range(len(texts) - 1, -1, -1), strict=True))
    index = TokenIndex(table)
    rng = random.Random(2)
    probes = [*texts, *("".join(rng.choices(ALPHABET, k=rng.randint(1, 7))) for _ in range(5000))]
    for text in probes:
        assert index.get(text) == first.get(text) == table.find(text)
        assert (text in index) == (text in first)
        assert table.ids_of(text) == [i for i, t in enumerate(texts) if t == text]
    with pytest.raises(KeyError):
        index["not a token at all"]


def test_a_gemma_sized_vocabulary_costs_a_few_mib_not_forty() -> None:
    """262,144 texts: as a list plus a dict ~40 MiB of Python objects; as a table with its index and
    a tokenizer's TokenIndex ~7 MiB (at most 10)."""
    texts = ["▁" + format(i * 7919, "x") + ("é" if i % 3 else "") for i in range(262_144)]
    tracemalloc.start()
    table = TextTable.from_strings(texts)
    index = TokenIndex(table)
    size, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert index.get(texts[123_456]) == 123_456
    assert size < 10 << 20, f"{size / 2**20:.1f} MiB"


def _write_vocab(path, tokens: list[bytes]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_vocabulary_is_read_into_a_table(tmp_path) -> None:
    tokens = _vocab(TEXT_TABLE_MIN + 100, seed=3)
    _write_vocab(tmp_path / "v.gguf", [t.encode() for t in tokens])
    for _ in range(2):  # parsed, then from the index cache with its hash buckets
        vocab = GGUFFile.open(tmp_path / "v.gguf", tmp_path / "index").metadata["tokenizer.ggml.tokens"]
        assert isinstance(vocab, TextTable) and vocab == tokens and vocab._buckets is not None
        assert vocab.find(tokens[500]) == tokens.index(tokens[500])


@pytest.mark.parametrize(
    "bad, at",
    [({700: b"a\xffb"}, 700), ({900: b"a\xc3", 901: b"\xa9b"}, 900)],  # a character cut across two tokens
)
def test_invalid_utf8_in_a_long_vocabulary_names_the_string(tmp_path, bad, at) -> None:
    tokens = [t.encode() for t in _vocab(TEXT_TABLE_MIN + 100, seed=4)[:-3]]
    for i, data in bad.items():
        tokens[i] = data
    _write_vocab(tmp_path / "b.gguf", tokens)
    with pytest.raises(ModelFormatError, match=f"string {at} of 'tokenizer.ggml.tokens' is not valid UTF-8"):
        GGUFFile.open(tmp_path / "b.gguf")
