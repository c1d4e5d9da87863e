"""SentencePiece tokenizer (tokenizer.ggml.model = "llama"): a tiny vocabulary built in-test (hermetic,
fast), then properties on llama.cpp's llama-spm test vocabulary (tests/data/vocab, 32k tokens).
Conformance with llama.cpp's ids is in test_tokenizer_vectors.py."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import DATA
from tiny_spm import BYTE, CONTROL, NORMAL, PIECES, SPECIALS, UNKNOWN, USER_DEFINED, S, tiny_metadata  # noqa: F401

from localllm.errors import ModelFormatError
from localllm.loading.file import GGUFFile
from localllm.tokenizer import Tokenizer, load_tokenizer
from localllm.tokenizer.spm import SPMTokenizer, _merge_heap, _merge_short

VOCAB = DATA / "vocab"

# -- a tiny SentencePiece vocabulary ----------------------------------------------------------------

# (piece, score): merges go highest score first; every intermediate of a merge must itself be a piece.


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer(tiny_metadata())


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.id_to_piece(i) for i in ids]


def test_llama_model_is_sentencepiece(tiny: Tokenizer) -> None:
    assert isinstance(tiny, SPMTokenizer) and tiny.add_space_prefix


def test_merges_highest_score_first(tiny: Tokenizer) -> None:
    assert pieces(tiny, tiny.encode("hello world", add_special=False)) == [S + "hello", S + "world"]
    assert pieces(tiny, tiny.encode("abc", add_special=False)) == [S, "ab", "c"]  # ab (-9) beats bc (-9.5)
    swapped = load_tokenizer(tiny_metadata([*PIECES[:11], ("ab", -9.5), ("bc", -9.0)]))
    assert pieces(swapped, swapped.encode("abc", add_special=False)) == [S, "a", "bc"]


def test_equal_scores_merge_leftmost_first(tiny: Tokenizer) -> None:
    assert pieces(tiny, tiny.encode("aaa", add_special=False)) == [S, "aa", "a"]
    assert pieces(tiny, tiny.encode("aaaaa", add_special=False)) == [S, "aa", "aa", "a"]


def test_a_piece_needs_a_chain_of_pieces(tiny: Tokenizer) -> None:
    # "abcd" is in the vocabulary with the best score, but neither "abc" nor "cd" is: it never forms.
    assert pieces(tiny, tiny.encode("abcd", add_special=False)) == [S, "ab", "c", "d"]


def test_byte_fallback_for_characters_not_in_the_vocabulary(tiny: Tokenizer) -> None:
    ids = tiny.encode("é!", add_special=False)
    assert pieces(tiny, ids) == [S, "<0xC3>", "<0xA9>", "<0x21>"]
    assert tiny.decode(ids) == "é!"
    assert tiny.token_bytes(ids[1]) == b"\xc3"


def test_space_prefix_follows_metadata() -> None:
    without = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(without, without.encode("hello world", add_special=False)) == ["hello", S + "world"]
    default = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": None}))
    assert default.add_space_prefix  # llama.cpp's default for SPM vocabularies


def test_space_prefix_after_special_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("<turn>hello<turn> hello", add_special=False, parse_special=True)
    # The text after each special token starts "input" again: a second space is added to " hello".
    assert pieces(tiny, ids) == ["<turn>", S + "hello", "<turn>", S, S + "hello"]
    plain = tiny.encode("<turn>hello", add_special=False)  # control tokens stay text without parse_special
    assert tiny.piece_to_id("<turn>") not in plain and tiny.decode(plain) == "<turn>hello"
    tool = tiny.encode("a<tool>b", add_special=False)  # user-defined tokens always match
    assert pieces(tiny, tool) == [S, "a", "<tool>", S, "b"]


def test_bos_eos_and_defaults(tiny: Tokenizer) -> None:
    hello = tiny.piece_to_id(S + "hello")
    assert tiny.encode("hello") == [1, hello]
    assert tiny.encode("") == [1] and tiny.encode("", add_special=False) == []
    both = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_eos_token": True}))
    assert both.encode("hello") == [1, hello, 2]
    defaults = load_tokenizer(
        tiny_metadata(**{k: None for k in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id")})
    )
    assert (defaults.add_bos, defaults.bos_id, defaults.eos_id) == (True, 1, 2)  # llama.cpp's SPM defaults


def test_decode_like_llama_cpp_detokenize(tiny: Tokenizer) -> None:
    ids = tiny.encode("hello world", add_special=False)
    assert tiny.token_bytes(ids[0]) == b" hello"
    assert tiny.decode(ids) == "hello world"  # the first token loses the space encode added
    with_bos = tiny.encode("hello world")
    assert tiny.decode(with_bos) == "<s> hello world"  # llama.cpp: BOS takes the strip, the space stays
    assert tiny.decode(with_bos, skip_special=True) == " hello world"
    assert tiny.decode(tiny.encode(" hi", add_special=False)) == " hi"  # only one space is stripped
    no_prefix = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert no_prefix.decode(tiny.encode("hello world", add_special=False)) == " hello world"
    assert tiny.decode([tiny.piece_to_id("<tool>")]) == "<tool>"


def test_inner_space_tokens_are_not_cut(tiny: Tokenizer) -> None:
    # "a▁b" is a token: the word cut before "▁" must not happen after "a".
    no_prefix = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(no_prefix, no_prefix.encode("a b", add_special=False)) == ["a" + S + "b"]
    assert pieces(no_prefix, no_prefix.encode("b b", add_special=False)) == ["b", S, "b"]


def test_scores_missing_or_short() -> None:
    flat = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.scores": None}))  # all 0: leftmost first
    assert pieces(flat, flat.encode("abc", add_special=False)) == [S, "ab", "c"]
    short = tiny_metadata()
    short["tokenizer.ggml.scores"] = short["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ModelFormatError, match="score"):
        load_tokenizer(short)


def test_float32_scores_are_kept_as_float32_and_merge_alike(tiny: Tokenizer) -> None:
    """A GGUF's scores (a float32 array) take 4 bytes a token, not a list of Python floats; the values
    and so the merges are the same."""
    meta = tiny_metadata()
    meta["tokenizer.ggml.scores"] = np.asarray(meta["tokenizer.ggml.scores"], np.float32)
    packed = load_tokenizer(meta)
    assert isinstance(packed._scores, array) and packed._scores.itemsize == 4
    assert list(packed._scores) == meta["tokenizer.ggml.scores"].tolist()
    text = "abc ab b a▁b hello"
    assert packed.encode(text) == tiny.encode(text)


def test_missing_byte_tokens_are_dropped() -> None:
    meta = tiny_metadata()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        meta[key] = meta[key][: len(SPECIALS)] + meta[key][len(SPECIALS) + 256 :]  # no <0xXX> tokens
    tok = load_tokenizer(meta)
    # llama.cpp throws here; we drop the bytes (an ASCII byte still matches a one-character token)
    assert pieces(tok, tok.encode("é a", add_special=False)) == [S, S, "a"]


_TINY_TEXT = st.lists(st.sampled_from([*"abcdehlorw é", S, "hello", "<tool>", "  "]), max_size=40).map(
    "".join
)


@settings(max_examples=300, deadline=None)
@given(text=_TINY_TEXT, prefix=st.booleans())
def test_word_cuts_merge_like_the_whole_text(text: str, prefix: bool) -> None:
    tok = _tiny_tokenizers()[prefix]
    escaped = ((" " if prefix else "") + text).replace(" ", S)
    whole = tok._symbol_ids(_merge_heap(list(escaped), tok._token_to_id, tok._scores))
    assert tok._tokenize_text(text, after_special=True) == whole


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*"abcdehlorw", S]), max_size=60))
def test_heap_merge_matches_scan_merge(chars: list[str]) -> None:
    tok = _tiny_tokenizers()[True]
    assert _merge_heap(list(chars), tok._token_to_id, tok._scores) == _merge_short(
        list(chars), tok._token_to_id, tok._scores
    )


_TINY_CACHE: dict[bool, SPMTokenizer] = {}


def _tiny_tokenizers() -> dict[bool, SPMTokenizer]:
    """By add_space_prefix (hypothesis tests cannot take function-scoped fixtures; build once)."""
    if not _TINY_CACHE:
        for prefix in (False, True):
            tok = load_tokenizer(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": prefix}))
            assert isinstance(tok, SPMTokenizer)
            _TINY_CACHE[prefix] = tok
    return _TINY_CACHE


# -- llama.cpp's llama-spm test vocabulary (LLaMA's 32k SentencePiece) ---------------------------------


@pytest.fixture(scope="module")
def llama_spm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SPMTokenizer:
    # The parsed index goes to pytest's cache when it is on (the gguf reader takes seconds on 32k tokens).
    cache = getattr(request.config, "cache", None)
    index_dir = cache.mkdir("gguf-index") if cache is not None else tmp_path_factory.mktemp("index")
    meta = GGUFFile.open(VOCAB / "ggml-vocab-llama-spm.gguf", index_dir).metadata
    tok = load_tokenizer(meta)
    assert isinstance(tok, SPMTokenizer)
    return tok


def test_llama_spm_basics(llama_spm: SPMTokenizer) -> None:
    ids = llama_spm.encode("Hello world")
    assert ids == [1, 15043, 3186]  # as llama.cpp: <s> ▁Hello ▁world
    assert llama_spm.decode(ids[1:]) == "Hello world"
    assert pieces(llama_spm, llama_spm.encode("🦙", add_special=False)) == [
        S,
        "<0xF0>",
        "<0x9F>",
        "<0xA6>",
        "<0x99>",
    ]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters=S), max_size=80))
def test_llama_spm_round_trip(llama_spm: SPMTokenizer, text: str) -> None:
    # Round trips hold without BOS and without parse_special (a special token re-adds a space prefix).
    assert llama_spm.decode(llama_spm.encode(text, add_special=False)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from([*"ab .é\n", "  ", "the", "ing", "Hello"]), max_size=40).map("".join))
def test_llama_spm_word_cuts_merge_like_the_whole_text(llama_spm: SPMTokenizer, text: str) -> None:
    escaped = (" " + text).replace(" ", S)
    whole = llama_spm._symbol_ids(_merge_heap(list(escaped), llama_spm._token_to_id, llama_spm._scores))
    assert llama_spm._tokenize_text(text, after_special=True) == whole
