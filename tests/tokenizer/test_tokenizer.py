"""Tokenizer tests: a tiny BPE vocabulary built in-test (hermetic, fast), then conformance with
llama.cpp's ids on the real SmolLM2 vocabulary (tests/data/smollm2_tokens.json)."""

from __future__ import annotations

import importlib
import json
import random
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import DATA

from localllm.errors import ModelFormatError
from localllm.text_table import TextTable
from localllm.tokenizer import TokenAttr, Tokenizer, load_tokenizer
from localllm.tokenizer.bpe import _merge_heap, _merge_short, byte_encode, byte_to_unicode
from localllm.tokenizer.pretokenizers import get_pretokenizer, supported_pretokenizers
from localllm.tokenizer.stream import IncrementalDecoder

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# -- a tiny byte-level BPE vocabulary ---------------------------------------------------------------

SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL)]
SPECIALS += [("<reponame>", CONTROL), ("<tool>", USER_DEFINED), ("<tool><call>", CONTROL)]
SPECIALS += [("<unused_x>", UNUSED)]
CHARS = list("!<>|_abcdehilmnorstwxy") + ["Ġ", "Ċ"]  # Ġ is the byte-level space, Ċ the newline
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "a b", "b c", "a a"]
EXTRA = ["hlo"]  # a token no merge produces (for ignore_merges)


def tiny_metadata(merges: list[str] = MERGES, **overrides: object) -> dict:
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = [t for t, _ in SPECIALS] + CHARS + list(dict.fromkeys(merged)) + EXTRA
    types = [k for _, k in SPECIALS] + [NORMAL] * (len(tokens) - len(SPECIALS))
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer(tiny_metadata())


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.id_to_piece(i) for i in ids]


def test_merges_follow_rank_order(tiny: Tokenizer) -> None:
    assert pieces(tiny, tiny.encode("hello world")) == ["hello", "Ġworld"]
    assert pieces(tiny, tiny.encode("abc")) == ["ab", "c"]
    swapped = load_tokenizer(tiny_metadata(merges=["b c", "a b"]))
    assert pieces(swapped, swapped.encode("abc")) == ["a", "bc"]


def test_equal_ranks_merge_leftmost_first(tiny: Tokenizer) -> None:
    assert pieces(tiny, tiny.encode("aaa")) == ["aa", "a"]
    assert pieces(tiny, tiny.encode("aaaaa")) == ["aa", "aa", "a"]


def test_unknown_bytes_are_dropped_like_llama_cpp(tiny: Tokenizer) -> None:
    # 'z' and 'é' have no token; llama.cpp emits nothing for them.
    assert pieces(tiny, tiny.encode("zaz")) == ["a"]
    assert tiny.encode("é") == []


def test_bos_eos_follow_metadata_and_add_special() -> None:
    tok = load_tokenizer(
        tiny_metadata(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True})
    )
    hello = tok.piece_to_id("hello")
    assert tok.encode("hello") == [1, hello, 2]
    assert tok.encode("hello", add_special=False) == [hello]
    assert tok.encode("", add_special=True) == [1, 2]
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2


def test_no_bos_when_the_model_says_so(tiny: Tokenizer) -> None:
    assert not tiny.add_bos
    assert tiny.encode("hello") == tiny.encode("hello", add_special=False)


def test_parse_special_splits_control_tokens(tiny: Tokenizer) -> None:
    text = "<|im_start|>hello<|im_end|>"
    assert tiny.encode(text, parse_special=True) == [1, tiny.piece_to_id("hello"), 2]
    plain = tiny.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert tiny.decode(plain) == text


def test_user_defined_tokens_match_without_parse_special(tiny: Tokenizer) -> None:
    tool = tiny.special_tokens["<tool>"]
    assert tiny.encode("a<tool>b") == [tiny.piece_to_id("a"), tool, tiny.piece_to_id("b")]


def test_longest_special_token_wins(tiny: Tokenizer) -> None:
    both = tiny.special_tokens["<tool><call>"]
    assert tiny.encode("<tool><call>", parse_special=True) == [both]
    # Without parse_special the control token is ignored and the user-defined one still matches.
    assert tiny.encode("<tool><call>")[0] == tiny.special_tokens["<tool>"]


def test_decode_and_skip_special(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>hello world<|im_end|>", parse_special=True)
    assert tiny.decode(ids) == "<|im_start|>hello world<|im_end|>"
    assert tiny.decode(ids, skip_special=True) == "hello world"
    assert tiny.token_bytes(tiny.piece_to_id("Ġworld")) == b" world"
    assert (
        tiny.token_bytes(tiny.special_tokens["<tool>"], skip_special=True) == b"<tool>"
    )  # user-defined stays


def test_token_attributes_and_unused(tiny: Tokenizer) -> None:
    unused = tiny.piece_to_id("<unused_x>")
    assert tiny.token_bytes(unused) == b""
    assert "<unused_x>" not in tiny.special_tokens
    assert tiny.is_special(0) and tiny.is_control(0)
    assert tiny.is_special(tiny.special_tokens["<tool>"]) and not tiny.is_control(
        tiny.special_tokens["<tool>"]
    )
    assert tiny.token_attr(0) & TokenAttr.CONTROL
    with pytest.raises(ValueError):
        tiny.token_bytes(tiny.vocab_size)


def test_eog_ids_like_llama_cpp(tiny: Tokenizer) -> None:
    # eos (2 = <|im_end|>), <|endoftext|> (end-like text) and <reponame> (FIM repo, as llama.cpp does)
    assert tiny.eog_ids == frozenset({0, 2, 3})
    assert tiny.is_eog(2) and not tiny.is_eog(1)


def test_eog_text_tokens_become_control() -> None:
    meta = tiny_metadata()
    meta["tokenizer.ggml.token_type"] = [NORMAL] * len(meta["tokenizer.ggml.tokens"])
    tok = load_tokenizer(meta)
    assert tok.is_control(0) and 0 in tok.eog_ids  # <|endoftext|> is promoted to a control token
    assert not tok.is_control(1)


def test_ignore_merges_for_llama3_style_pre() -> None:
    llama3 = load_tokenizer(
        tiny_metadata(**{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None})
    )
    assert pieces(llama3, llama3.encode("hlo", add_special=False)) == ["hlo"]
    assert llama3.add_bos  # llama.cpp's default for llama3 when the GGUF has no add_bos_token
    smollm = load_tokenizer(tiny_metadata())
    assert pieces(smollm, smollm.encode("hlo")) == ["h", "l", "o"]


def test_unknown_model_and_pre_are_format_errors() -> None:
    with pytest.raises(ModelFormatError, match="'xyz' is not supported"):
        load_tokenizer(tiny_metadata(**{"tokenizer.ggml.model": "xyz"}))
    with pytest.raises(ModelFormatError, match="'nope'"):
        load_tokenizer(tiny_metadata(**{"tokenizer.ggml.pre": "nope"}))
    with pytest.raises(ModelFormatError):
        load_tokenizer({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelFormatError, match="merges"):
        load_tokenizer(tiny_metadata(**{"tokenizer.ggml.merges": None}))


def test_byte_level_table_is_a_bijection() -> None:
    table = byte_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert byte_encode(" é") == "ĠÃ©"


def test_tables_are_compact_and_share_the_metadata_strings() -> None:
    """A 150k vocabulary is 150k strings: the tokenizer keeps the metadata's TextTable (one blob), never
    a copy; merge ranks are keyed by the merge's text, not a tuple of two new halves; attributes take a
    byte."""
    meta = tiny_metadata()
    table = TextTable.from_strings(meta["tokenizer.ggml.tokens"])
    tok = load_tokenizer({**meta, "tokenizer.ggml.tokens": table})
    assert tok._tokens is table and list(table) == meta["tokenizer.ggml.tokens"]
    assert isinstance(tok._attrs, bytearray)
    merge_ids = {id(m) for m in meta["tokenizer.ggml.merges"]}
    assert tok._ranks and all(id(k) in merge_ids for k in tok._ranks)
    assert all(tok._token_to_id[t] == i for i, t in enumerate(table))


def test_a_text_listed_twice_keeps_its_first_id_and_empty_tokens_are_renamed() -> None:
    meta = tiny_metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    extra = {"tokenizer.ggml.tokens": [*tokens, "hello", ""], "tokenizer.ggml.token_type": [*types, 1, 1]}
    twice = load_tokenizer(tiny_metadata(**extra))
    assert twice.piece_to_id("hello") == tokens.index("hello")
    assert twice.id_to_piece(len(tokens) + 1) == f"[EMPTY_{len(tokens) + 1}]"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdehlorw"), max_size=60))
def test_heap_merge_matches_scan_merge(chars: list[str]) -> None:
    ranks = {m: i for i, m in enumerate(MERGES)}
    assert _merge_heap(list(chars), ranks) == _merge_short(list(chars), ranks)


# -- pre-tokenizers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pre, text, expected",
    [
        ("smollm", "Hello, world!", ["Hello", ",", " world", "!"]),
        ("smollm", "n < 2", ["n", " <", " ", "2"]),  # digits are cut out first
        ("smollm", "  1", ["  ", "1"]),  # so whitespace before them stays whole
        ("gpt-2", "  1", [" ", " 1"]),
        ("smollm", "a  b\t\tc ", ["a", " ", " b", "\t", "\t", "c", " "]),
        ("smollm", "it's 'S", ["it", "'s", " '", "S"]),
        ("llama-bpe", "I'M 12345\r\n\n x", ["I", "'M", " ", "123", "45", "\r\n\n", " x"]),
        ("qwen2", "abc 123", ["abc", " ", "1", "2", "3"]),
        ("default", "a+b=c", ["a", "+", "b", "=", "c"]),
    ],
)
def test_pretokenizer_splits(pre: str, text: str, expected: list[str]) -> None:
    assert get_pretokenizer(pre).split(text) == expected


@pytest.mark.parametrize("pre", supported_pretokenizers())
def test_every_pretokenizer_covers_its_input(pre: str) -> None:
    text = "Hello World! It's 2024: café naïve 日本語 😀 x=1+2 \t\r\n  end  "
    words = get_pretokenizer(pre).split(text)
    assert "".join(words) == text and all(words)


# -- streaming --------------------------------------------------------------------------------------


class _ChunkTokenizer:
    """Token i stands for chunks[i]; token 0 is a control token."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        if token_id == 0 and skip_special:
            return b""
        return self.chunks[token_id]


def _stream(chunks: list[bytes], skip_special: bool = True) -> list[str]:
    decoder = IncrementalDecoder(_ChunkTokenizer(chunks), skip_special=skip_special)
    return [decoder.add(i) for i in range(len(chunks))] + [decoder.flush()]


def test_stream_holds_back_split_characters() -> None:
    rocket = "🚀".encode()
    assert _stream([b"<s>", b"Hi ", rocket[:2], rocket[2:3], rocket[3:] + b"!"]) == [
        "",
        "Hi ",
        "",
        "",
        "🚀!",
        "",
    ]
    cjk = "日本".encode()
    assert _stream([b"", cjk[:1], cjk[1:4], cjk[4:]]) == ["", "", "日", "本", ""]


def test_stream_invalid_bytes_become_replacement_once_certain() -> None:
    assert _stream([b"", b"\xf0\x9f", b"A"]) == ["", "", "\ufffdA", ""]
    assert _stream([b"", b"ok\xe6\x97"]) == ["", "ok", "\ufffd"]  # cut off at the end: flushed as U+FFFD
    assert _stream([b"", b"\xff"]) == ["", "\ufffd", ""]


def test_stream_special_tokens() -> None:
    assert _stream([b"<|im_end|>", b"x"], skip_special=False) == ["<|im_end|>", "x", ""]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40), st.data())
def test_stream_concatenation_equals_full_decode(text: str, data: st.DataObject) -> None:
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    chunks = [b""] + [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    out = _stream(chunks)
    assert "".join(out) == text and all("\ufffd" not in s for s in out)


# -- the real SmolLM2 vocabulary vs llama.cpp -------------------------------------------------------

CASES = json.loads((DATA / "smollm2_tokens.json").read_text(encoding="utf-8"))
MODES = [(a, p) for a in (0, 1) for p in (0, 1)]


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path, index_dir: Path) -> Tokenizer:
    from localllm.loading.file import GGUFFile

    return load_tokenizer(GGUFFile.open(smollm2_path, index_dir).metadata)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("add_special, parse_special", MODES)
def test_smollm2_ids_match_llama_cpp(
    smollm2: Tokenizer, case: dict, add_special: int, parse_special: int
) -> None:
    expected = case[f"ids_add_special={add_special}_parse_special={parse_special}"]
    assert (
        smollm2.encode(case["text"], add_special=bool(add_special), parse_special=bool(parse_special))
        == expected
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: c["name"])
def test_smollm2_pieces_and_round_trip(smollm2: Tokenizer, case: dict) -> None:
    ids = case["ids_add_special=1_parse_special=1"]
    got = [smollm2.token_bytes(i).decode("utf-8", errors="backslashreplace") for i in ids]
    assert got == case["pieces_parse_special=1"]
    for parse_special in (False, True):
        assert smollm2.decode(smollm2.encode(case["text"], parse_special=parse_special)) == case["text"]


@pytest.mark.slow
def test_smollm2_vocab_facts(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == CASES["n_vocab"]
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos) == (CASES["bos_id"], CASES["eos_id"], False)
    assert sorted(smollm2.eog_ids) == CASES["eog_ids"]
    assert smollm2.special_tokens["<|im_start|>"] == 1
    assert smollm2.id_to_piece(905) == "Ġworld"


# SmolLM2 has no token for these bytes (nor has llama.cpp, which drops them too): control chars
# 0x04 0x06 0x13 0x14 0x16 0x1d, and lead bytes 0xF1/0xF2, i.e. code points U+40000..U+BFFFF.
_NO_TOKEN_CHARS = "\x04\x06\x13\x14\x16\x1d"
_ROUND_TRIP_CHARS = st.characters(exclude_characters=_NO_TOKEN_CHARS, exclude_categories=["Cs"]).filter(
    lambda c: not 0x40000 <= ord(c) < 0xC0000
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=_ROUND_TRIP_CHARS, max_size=80), parse_special=st.booleans())
def test_smollm2_round_trip(smollm2: Tokenizer, text: str, parse_special: bool) -> None:
    assert smollm2.decode(smollm2.encode(text, parse_special=parse_special)) == text


@pytest.mark.slow
def test_smollm2_bytes_without_tokens_are_dropped(smollm2: Tokenizer) -> None:
    assert smollm2.encode("a\x04b") == smollm2.encode("a") + smollm2.encode("b")
    ids = smollm2.encode("\U00040000")  # F1 80 80 80: only the continuation bytes survive
    assert [smollm2.token_bytes(i) for i in ids] == [b"\x80"] * 3


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), min_size=20, max_size=200))
def test_smollm2_heap_merge_matches_scan_merge(smollm2: Tokenizer, text: str) -> None:
    symbols = list(byte_encode(text))
    assert _merge_heap(list(symbols), smollm2._ranks) == _merge_short(list(symbols), smollm2._ranks)


@pytest.mark.slow
def test_smollm2_streaming_emoji_and_cjk(smollm2: Tokenizer) -> None:
    text = "Rocket 🚀, thumbs 👍🏽, 日本語のテキスト, 🧑\u200d💻 done."
    ids = smollm2.encode(text)
    decoder = IncrementalDecoder(smollm2)
    outs = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert "".join(outs) == text
    assert "" in outs and all("\ufffd" not in s for s in outs)  # some tokens were partial characters


def english_text(n_bytes: int) -> str:
    """~n_bytes of varied English prose: the standard library's docstrings."""
    parts: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this"}:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        docs = [getattr(o, "__doc__", None) for o in [module, *vars(module).values()]]
        parts += [d for d in docs if isinstance(d, str) and len(d) > 200]
        if sum(map(len, parts)) > 2 * n_bytes:
            break
    return "\n\n".join(dict.fromkeys(parts)).encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


@pytest.mark.slow
def test_smollm2_speed_100kb_english(smollm2: Tokenizer) -> None:
    """Reports the time for 100 KB of English (no timing assertion: the lead measures)."""
    text = english_text(100_000)
    smollm2._word_cache.clear()
    start = time.perf_counter()
    ids = smollm2.encode(text)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    smollm2.encode(text)
    warm = time.perf_counter() - start
    print(f"\n100 KB English: {len(ids)} tokens, {cold * 1000:.0f} ms cold cache, {warm * 1000:.0f} ms warm")
    assert smollm2.decode(ids) == text


@pytest.mark.slow
def test_smollm2_long_word_uses_heap_path(smollm2: Tokenizer) -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("我爱北京天安门今天天气很好人工智能正在改变世界") for _ in range(5000))
    ids = smollm2.encode(text)  # one pre-token word of 15,000 bytes: must not be quadratic
    assert smollm2.decode(ids) == text
