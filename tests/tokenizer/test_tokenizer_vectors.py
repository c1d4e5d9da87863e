"""Conformance with llama.cpp's token ids.

1. llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf with .inp/.out, copied into
   tests/data/vocab/ by fixtures/make_vocab_fixtures.py), run as tests/test-tokenizer-0.cpp runs them:
   SentencePiece (llama-spm, phi-3) and gpt-2 on their vocabulary-only GGUFs, the other byte-level BPE
   vocabularies (1-11 MB each) on exact extracts of them (the script proves each extract tokenizes
   every input as the whole vocabulary does).
2. Ids llama.cpp (b11312) gave for the real Gemma 3 (SentencePiece, 262k tokens) and Qwen2.5-Coder
   (byte-level BPE, qwen2 pre-tokenizer) vocabularies, in all add_special / parse_special modes
   (tests/data/<model>/tokens.json, from /work/shared/reference).
"""

from __future__ import annotations

import json
import lzma
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import DATA

from localllm.loading.file import GGUFFile
from localllm.tokenizer import Tokenizer, load_tokenizer
from localllm.tokenizer.spm import SPACE, SPMTokenizer, _merge_heap

VOCAB = DATA / "vocab"
GGUF_VOCABS = ["llama-spm", "phi-3", "gpt-2"]  # SentencePiece (Llama 2, Phi-3) and GPT-2's BPE
# byte-level BPE with their pre-tokenizers: Llama 3, Qwen2/2.5, Qwen3.5, StarCoder, DeepSeek, ...
EXTRACT_VOCABS = [
    "llama-bpe", "qwen2", "qwen35", "starcoder", "deepseek-coder", "deepseek-llm", "falcon", "mpt",
    "refact", "command-r", "gemma-4",
]  # fmt: skip
VOCABS = GGUF_VOCABS + EXTRACT_VOCABS
SEPARATOR = "\n__ggml_vocab_test__\n"
PLACEHOLDER = "\ue000"  # make_vocab_fixtures.py's text for a token the extract leaves out


# -- 1. llama.cpp's test vectors --------------------------------------------------------------------


def read_vectors(name: str) -> dict[str, list[int]]:
    """test-tokenizer-0.cpp's read_tests: inputs split at the separator (a trailing one ends the list),
    one output line per input, stripped; a std::map, so a repeated input keeps its last ids."""
    raw = (VOCAB / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")  # bytes: keep any \r
    inputs = raw.split(SEPARATOR)
    if inputs and inputs[-1] == "":
        inputs.pop()
    lines = (VOCAB / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    lines = lines[: len(inputs)]
    assert len(lines) == len(inputs), f"{name}: {len(inputs)} inputs but {len(lines)} output lines"
    return {text: [int(t) for t in line.split()] for text, line in zip(inputs, lines, strict=True)}


def vector_cases() -> list[tuple[str, str, list[int]]]:
    return [(name, text, ids) for name in VOCABS for text, ids in read_vectors(name).items()]


@pytest.fixture(scope="session")
def vocab_index_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the parsed GGUF indexes go: pytest's cache (kept between runs: the gguf reader needs
    ~20 s for these vocabularies) when the cache plugin is on, else a temporary directory."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("gguf-index") if cache is not None else tmp_path_factory.mktemp("vocab-index")


def extract_metadata(name: str) -> dict:
    """The tokenizer metadata of an extract (make_vocab_fixtures.py's `expand`)."""
    data = json.loads(lzma.decompress((VOCAB / f"ggml-vocab-{name}.json.xz").read_bytes()))
    n = data["n_tokens"]
    return {
        **data["keys"],
        "tokenizer.ggml.tokens": [data["tokens"].get(str(i), f"{PLACEHOLDER}{i}") for i in range(n)],
        "tokenizer.ggml.token_type": [data["types"].get(str(i), 1) for i in range(n)],
        "tokenizer.ggml.merges": data["merges"],
    }


@pytest.fixture(scope="session")
def vocab_tokenizer(vocab_index_dir: Path) -> Callable[[str], Tokenizer]:
    loaded: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in loaded:
            if name in EXTRACT_VOCABS:
                loaded[name] = load_tokenizer(extract_metadata(name))
            else:
                path = VOCAB / f"ggml-vocab-{name}.gguf"
                loaded[name] = load_tokenizer(GGUFFile.open(path, vocab_index_dir).metadata)
        return loaded[name]

    return get


@pytest.mark.parametrize(
    "name, text, expected",
    vector_cases(),
    ids=[f"{n}-{i}" for n in VOCABS for i in range(len(read_vectors(n)))],
)
def test_llama_cpp_vectors(vocab_tokenizer, name: str, text: str, expected: list[int]) -> None:
    # test-tokenizer-0.cpp: common_tokenize(ctx, text, add_special=false, parse_special=false), text as is.
    assert vocab_tokenizer(name).encode(text, add_special=False, parse_special=False) == expected


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors_round_trip(vocab_tokenizer, name: str) -> None:
    tok = vocab_tokenizer(name)
    for text, expected in read_vectors(name).items():
        assert tok.decode(expected) == text


def test_vector_vocab_types(vocab_tokenizer) -> None:
    spm = vocab_tokenizer("llama-spm")
    assert isinstance(spm, SPMTokenizer) and spm.add_space_prefix and spm.add_bos
    assert (spm.bos_id, spm.eos_id, spm.vocab_size) == (1, 2, 32000)
    phi3 = vocab_tokenizer("phi-3")
    assert isinstance(phi3, SPMTokenizer) and phi3.vocab_size == 32064
    pre = {
        n: vocab_tokenizer(n).pre.name for n in ("qwen2", "gpt-2", "llama-bpe", "deepseek-llm", "command-r")
    }
    assert list(pre.values()) == ["qwen2", "gpt2", "llama3", "deepseek-llm", "starcoder"]


@pytest.mark.parametrize("name", VOCABS)
def test_every_vector_file_is_read(name: str) -> None:
    assert len(read_vectors(name)) >= 46


# -- 2. the real models' vocabularies --------------------------------------------------------------

GEMMA3 = json.loads((DATA / "gemma3" / "tokens.json").read_text(encoding="utf-8"))
QWEN25C = json.loads((DATA / "qwen25c" / "tokens.json").read_text(encoding="utf-8"))
MODES = [(a, p) for a in (0, 1) for p in (0, 1)]


def _model_home() -> Path:
    return Path(os.environ.get("LOCALLLM_HOME", "~/.cache/localllm")).expanduser()


def _resolve(name: str) -> Path:
    from localllm.registry import load_registry, resolve_model

    return resolve_model(name, _model_home(), load_registry(None), progress=False).path


def _open_tokenizer(path: Path) -> Tokenizer:
    # The CLI's index cache: the gguf reader needs ~20 s for a 262k vocabulary, the cached index ~0.2 s.
    return load_tokenizer(GGUFFile.open(path, _model_home() / "index").metadata)


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path) -> Tokenizer:
    return _open_tokenizer(gemma3_path)


@pytest.fixture(scope="session")
def qwen25c(qwen25c_path: Path) -> Tokenizer:
    return _open_tokenizer(qwen25c_path)


def _check_case(tok: Tokenizer, case: dict, add_special: int, parse_special: int) -> None:
    expected = case[f"ids_add_special={add_special}_parse_special={parse_special}"]
    got = tok.encode(case["text"], add_special=bool(add_special), parse_special=bool(parse_special))
    assert got == expected


def _check_pieces_and_round_trip(tok: Tokenizer, case: dict) -> None:
    ids = case["ids_add_special=1_parse_special=1"]
    pieces = [tok.token_bytes(i).decode("utf-8", errors="backslashreplace") for i in ids]
    assert pieces == case["pieces_parse_special=1"]
    for parse_special in (False, True):
        ids = tok.encode(case["text"], add_special=False, parse_special=parse_special)
        assert tok.decode(ids) == case["text"]


def _check_vocab_facts(tok: Tokenizer, ref: dict) -> None:
    assert tok.vocab_size == ref["n_vocab"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref["bos_id"], ref["eos_id"], ref["vocab_add_bos"])
    assert sorted(tok.eog_ids) == ref["eog_ids"]
    assert [tok.id_to_piece(i) for i in ref["eog_ids"]] == ref["eog_pieces"]


@pytest.mark.slow
@pytest.mark.parametrize("case", GEMMA3["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("add_special, parse_special", MODES)
def test_gemma3_ids_match_llama_cpp(
    gemma3: Tokenizer, case: dict, add_special: int, parse_special: int
) -> None:
    _check_case(gemma3, case, add_special, parse_special)


@pytest.mark.slow
@pytest.mark.parametrize("case", GEMMA3["cases"], ids=lambda c: c["name"])
def test_gemma3_pieces_and_round_trip(gemma3: Tokenizer, case: dict) -> None:
    _check_pieces_and_round_trip(gemma3, case)


GEMMA3_VECTORS = json.loads((DATA / "gemma3" / "vectors.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.slow
@pytest.mark.parametrize("case", GEMMA3_VECTORS, ids=[str(i) for i in range(len(GEMMA3_VECTORS))])
def test_gemma3_llama_tokenize_vectors(gemma3: Tokenizer, case: dict) -> None:
    """Gemma's SentencePiece (2 and 3 share it) against llama-tokenize on varied texts
    (fixtures/make_gemma3_vectors.py): as plain text, and as a prompt (BOS, special tokens parsed)."""
    assert gemma3.encode(case["text"], add_special=False, parse_special=False) == case["plain"]
    assert gemma3.encode(case["text"], add_special=True, parse_special=True) == case["prompt"]


@pytest.mark.slow
def test_gemma3_vocab_facts(gemma3: Tokenizer) -> None:
    _check_vocab_facts(gemma3, GEMMA3)
    assert isinstance(gemma3, SPMTokenizer) and not gemma3.add_space_prefix
    assert gemma3.special_tokens["<start_of_turn>"] == 105


@pytest.mark.slow
@pytest.mark.parametrize("case", QWEN25C["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("add_special, parse_special", MODES)
def test_qwen25c_ids_match_llama_cpp(
    qwen25c: Tokenizer, case: dict, add_special: int, parse_special: int
) -> None:
    _check_case(qwen25c, case, add_special, parse_special)


@pytest.mark.slow
@pytest.mark.parametrize("case", QWEN25C["cases"], ids=lambda c: c["name"])
def test_qwen25c_pieces_and_round_trip(qwen25c: Tokenizer, case: dict) -> None:
    _check_pieces_and_round_trip(qwen25c, case)


@pytest.mark.slow
def test_qwen25c_vocab_facts(qwen25c: Tokenizer) -> None:
    _check_vocab_facts(qwen25c, QWEN25C)


# -- Gemma 3: properties and speed on the 262k vocabulary ------------------------------------------


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters=SPACE), max_size=120),
    parse_special=st.booleans(),
)
def test_gemma3_round_trip(gemma3: Tokenizer, text: str, parse_special: bool) -> None:
    # A "▁" in the text itself comes back as a space, in llama.cpp too: SentencePiece cannot tell them apart.
    ids = gemma3.encode(text, add_special=False, parse_special=parse_special)
    assert gemma3.decode(ids) == text


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*"ab >/<é日\n", SPACE, "the", "ing", "  "]), max_size=40).map("".join))
def test_gemma3_word_cuts_merge_like_the_whole_text(gemma3: Tokenizer, text: str) -> None:
    """Cutting the text into words (and caching them) gives what one merge over the whole text does."""
    assert isinstance(gemma3, SPMTokenizer)
    whole = gemma3._symbol_ids(
        _merge_heap(list(text.replace(" ", SPACE)), gemma3._token_to_id, gemma3._scores)
    )
    assert gemma3._tokenize_text(text, after_special=False) == whole


@pytest.mark.slow
def test_gemma3_speed(gemma3_path: Path) -> None:
    """Reports build and encode times (no timing assertion: the lead measures)."""
    meta = GGUFFile.open(gemma3_path, _model_home() / "index").metadata
    start = time.perf_counter()
    tok = load_tokenizer(meta)
    build = time.perf_counter() - start
    text = (Path(__file__).read_text(encoding="utf-8").replace(SPACE, "_") * 40)[:100_000]
    times = []
    for size in (4_000, 100_000):
        start = time.perf_counter()
        ids = tok.encode(text[:size])
        times.append(f"{size // 1000} KB: {len(ids)} tokens in {(time.perf_counter() - start) * 1000:.0f} ms")
        assert tok.decode(ids, skip_special=True) == text[:size]
    print(f"\nGemma 3 tokenizer: built in {build * 1000:.0f} ms; " + "; ".join(times))


def test_an_unsupported_pre_tokenizer_is_one_line(tmp_path: Path) -> None:
    """A `tokenizer.ggml.pre` localllm does not know (one llama.cpp added later) is refused by name."""
    import subprocess
    import sys

    import gguf
    from tiny_model import vocabulary

    path, (tokens, types, merges) = tmp_path / "kimi.gguf", vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "localllm", "tokenize", str(path), "hi"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode != 0 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "'kimi-k2' is not supported" in out.stderr
