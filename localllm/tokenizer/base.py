"""The base every tokenizer builds on, as llama.cpp's llama_vocab: token attributes, special-token
splitting (parse_special), BOS/EOS handling, the end-of-generation set and decoding.

Byte-level BPE (bpe.py) and SentencePiece (spm.py) subclass `Tokenizer`, implementing `_tokenize_text`
and `_normal_token_bytes`; `localllm.tokenizer.load_tokenizer` picks one from the GGUF's metadata.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

from localllm.errors import ModelFormatError
from localllm.text_table import TextTable
from localllm.tokenizer.token_index import TokenIndex

__all__ = ["Tokenizer", "TokenAttr"]


_WORD_CACHE_LIMIT = 200_000  # words; cleared when full so a long-running server cannot grow without bound
_KEY = 3  # special pieces are prefiltered by their first _KEY characters


class TokenAttr(enum.IntFlag):
    """llama.cpp's llama_token_attr subset that tokenization depends on."""

    UNDEFINED = 0
    UNKNOWN = 1
    UNUSED = 2
    NORMAL = 4
    CONTROL = 8
    USER_DEFINED = 16
    BYTE = 32


# Attributes are plain ints internally: IntFlag arithmetic is slow over 100k+ tokens.
_NORMAL, _CONTROL, _BYTE, _UNUSED = (int(TokenAttr[n]) for n in ("NORMAL", "CONTROL", "BYTE", "UNUSED"))
_TYPE_TO_ATTR = {  # GGUF tokenizer.ggml.token_type values (gguf.TokenType)
    1: _NORMAL,
    2: int(TokenAttr.UNKNOWN),
    3: _CONTROL,
    4: int(TokenAttr.USER_DEFINED),
    5: _UNUSED,
    6: _BYTE,
}
_SPECIAL = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
_HIDDEN = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)  # what skip_special drops (llama.cpp's special=false)

# llama.cpp finds these roles by token text when the GGUF has no id for them (llama-vocab.cpp).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = (
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
)
_FIM_SUF_TEXTS = (
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
)
_FIM_MID_TEXTS = (
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)
# role -> (GGUF key suffix, texts to look for when the key is absent); FIM pad/repo/sep end generation.
_TEXT_ROLES = {
    "eot": ("eot_token_id", _EOT_TEXTS),
    "eom": ("eom_token_id", _EOM_TEXTS),
    "fim_pre": ("fim_pre_token_id", _FIM_PRE_TEXTS),
    "fim_suf": ("fim_suf_token_id", _FIM_SUF_TEXTS),
    "fim_mid": ("fim_mid_token_id", _FIM_MID_TEXTS),
    "fim_pad": ("fim_pad_token_id", _FIM_PAD_TEXTS),
    "fim_rep": ("fim_rep_token_id", _FIM_REP_TEXTS),
    "fim_sep": ("fim_sep_token_id", _FIM_SEP_TEXTS),
}


class Tokenizer(ABC):
    """A GGUF vocabulary: text <-> token ids with llama.cpp's semantics.

    Subclasses set how plain text becomes ids (`_tokenize_text`) and what bytes a normal token
    stands for (`_normal_token_bytes`); everything about special tokens is shared here.
    """

    # llama.cpp's per-model-type defaults, used when the GGUF lacks the key.
    default_bos_id: int | None = None
    default_eos_id: int | None = None
    default_add_bos: bool = False

    def __init__(self, metadata: Mapping[str, Any]):
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise ModelFormatError("the model file has no tokenizer vocabulary (tokenizer.ggml.tokens).")
        self._tokens: TextTable = _token_texts(tokens)
        self._token_to_id = TokenIndex(self._tokens)  # the first id of a text that occurs twice
        n = len(self._tokens)
        self._attrs = _read_attrs(metadata, n)
        self.bos_id = _token_id(metadata, "bos_token_id", self.default_bos_id, len(self._tokens))
        self.eos_id = _token_id(metadata, "eos_token_id", self.default_eos_id, len(self._tokens))
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", self.default_add_bos))
        self.add_eos: bool = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise ModelFormatError("the model asks for a BOS token but does not say which one it is.")
        self._roles = self._find_roles(metadata)
        self.eog_ids: frozenset[int] = self._end_of_generation_ids()
        self.special_tokens: dict[str, int] = {self._tokens[i]: i for i in self._special_order()}
        # special pieces indexed by their first characters, so a long text is not scanned once per piece
        # (Gemma has 6,400 of them)
        self._special_by_key: dict[str, list[tuple[int, str, int]]] = {}
        for rank, (piece, tid) in enumerate(self.special_tokens.items()):
            self._special_by_key.setdefault(piece[:_KEY], []).append((rank, piece, tid))
        self._hidden_ids = frozenset(i for i, a in enumerate(self._attrs) if a & _HIDDEN)
        self._bytes_cache: dict[int, bytes] = {}
        self._word_cache: dict[str, tuple[int, ...]] = {}

    # -- public API --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for `text`, as llama_tokenize(vocab, text, add_special, parse_special) gives them.

        add_special adds BOS/EOS where the model asks for them (tokenizer.ggml.add_bos_token /
        add_eos_token); parse_special turns control tokens written in the text (e.g. `<|im_start|>`)
        into their ids instead of tokenizing their characters. User-defined tokens always match.
        """
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]  # checked in __init__
        after_special = True
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids.extend(self._tokenize_text(fragment, after_special))
                after_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The raw bytes a token stands for (maybe part of a UTF-8 character).

        Control and unknown tokens give their text unless skip_special; unused ones give nothing.
        """
        if skip_special and token_id in self._hidden_ids:
            return b""
        data = self._bytes_cache.get(token_id)
        if data is None:
            data = self._bytes_cache[token_id] = self._compute_bytes(token_id)
        return data

    def id_to_piece(self, token_id: int) -> str:
        """The token as the vocabulary stores it (for BPE the byte-level form, e.g. 'Ġworld')."""
        self._attr(token_id)
        return self._tokens[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        return self._token_to_id.get(piece)

    def is_special(self, token_id: int) -> bool:
        """Control, user-defined or unknown: the tokens parse_special can produce from text."""
        return bool(self._attr(token_id) & _SPECIAL)

    def is_control(self, token_id: int) -> bool:
        """Control or unknown: the tokens decode(skip_special=True) leaves out."""
        return bool(self._attr(token_id) & _HIDDEN)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_attr(self, token_id: int) -> TokenAttr:
        return TokenAttr(self._attr(token_id))

    # -- for subclasses ----------------------------------------------------------------------------

    @abstractmethod
    def _tokenize_text(self, text: str, after_special: bool) -> list[int]:
        """Ids for a run of plain text (no special tokens in it); after_special: it starts the input
        or follows a special token (SentencePiece adds its space prefix there)."""

    @abstractmethod
    def _normal_token_bytes(self, token_id: int) -> bytes:
        """The bytes a NORMAL token stands for."""

    # -- internals ---------------------------------------------------------------------------------

    def _compute_bytes(self, token_id: int) -> bytes:
        attr = self._attr(token_id)
        if attr & _SPECIAL:
            return self._tokens.raw(token_id)
        if attr & _NORMAL:
            return self._normal_token_bytes(token_id)
        if attr & _BYTE:
            return bytes([int(self._tokens[token_id][3:5], 16)])  # "<0xAB>"
        return b""

    def _attr(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")
        return self._attrs[token_id]

    def _find_roles(self, metadata: Mapping[str, Any]) -> dict[str, int]:
        """eot/eom/FIM ids from the GGUF, else by token text; such tokens become control tokens."""
        roles: dict[str, int] = {}
        for role, (key, texts) in _TEXT_ROLES.items():
            found = _token_id(metadata, key, None, len(self._tokens))
            if found is None:
                found = next((self._token_to_id[t] for t in texts if t in self._token_to_id), None)
                if found is not None:
                    self._attrs[found] |= _CONTROL
            if found is not None:
                roles[role] = found
        return roles

    def _end_of_generation_ids(self) -> frozenset[int]:
        """llama.cpp's special_eog_ids: FIM pad/repo/sep, tokens with end-like text, eos, eot, eom."""
        eog = {self._roles[r] for r in ("fim_pad", "fim_rep", "fim_sep") if r in self._roles}
        for i in (i for text in _EOG_TEXTS for i in self._token_to_id.ids_of(text)):
            eog.add(i)
            self._attrs[i] |= _CONTROL
        eog.update(t for t in (self.eos_id, self._roles.get("eot"), self._roles.get("eom")) if t is not None)
        texts = {self._tokens[i]: i for i in eog}
        # gpt-oss (harmony) / solar-open: <|end|> ends a message, not the generation.
        if "<|end|>" in texts and (
            {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
        ):
            eog.discard(texts["<|end|>"])
        # gemma4 / paddleocr: </s> is not an end when <|tool_response> is.
        if "</s>" in texts and "<|tool_response>" in texts:
            eog.discard(texts["</s>"])
        return frozenset(eog)

    def _special_order(self) -> list[int]:
        """Special tokens, longest text first: the order llama.cpp tries them when splitting text."""
        ids = [i for i, a in enumerate(self._attrs) if a & _SPECIAL]
        return sorted(ids, key=lambda i: -len(self._tokens[i]))

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split text at special tokens (tokenizer_st_partition): each one, longest first, cuts
        every remaining text fragment at all its occurrences."""
        fragments: list[str | int] = [text] if text else []
        for _, piece, tid in self._special_candidates(text):
            if piece not in text or (not parse_special and self._attrs[tid] & _HIDDEN):
                continue
            fragments = [part for f in fragments for part in _cut(f, piece, tid)]
        return fragments

    def _encode_words(self, words: Iterable[str]) -> list[int]:
        """The ids of pre-tokenized words, memoised per word: text repeats words, and merging is the
        slow part. Subclasses provide `_word_ids(word)`."""
        out: list[int] = []
        cache = self._word_cache
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = self._word_ids(word)
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _word_ids(self, word: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _special_candidates(self, text: str) -> list[tuple[int, str, int]]:
        """Special pieces that may occur in text (a superset), in longest-first order."""
        by_key = self._special_by_key
        grams = {text[i : i + _KEY] for i in range(len(text))}
        found = [e for k in grams & by_key.keys() for e in by_key[k]]
        found += [e for k, es in by_key.items() if len(k) < _KEY and k in text for e in es]
        return sorted(set(found))


def _cut(fragment: str | int, piece: str, tid: int) -> list[str | int]:
    if isinstance(fragment, int) or piece not in fragment:
        return [fragment]
    out: list[str | int] = []
    for k, part in enumerate(fragment.split(piece)):
        if k:
            out.append(tid)
        if part:
            out.append(part)
    return out


def _token_texts(tokens: Any) -> TextTable:
    """The vocabulary as one blob: the metadata's own table when it can serve as is (a str object per
    token would take several times the blob's memory). llama.cpp renames empty tokens so they never
    match text."""
    table = tokens if isinstance(tokens, TextTable) else None
    if table is not None and table.byte_lengths().all():
        return table
    return TextTable.from_strings(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))


def _read_attrs(metadata: Mapping[str, Any], n: int) -> bytearray:
    """One byte of TokenAttr flags per token (all flags fit in 6 bits; a list would take 8 bytes)."""
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return bytearray([_NORMAL]) * n
    if len(types) < n:
        raise ModelFormatError("the model's token type list is shorter than its vocabulary.")
    attrs = bytearray(_TYPE_TO_ATTR.get(t, 0) for t in _as_ints(types[:n]))
    # llama.cpp: control tokens whose text says "unused" are unused.
    tokens = metadata["tokenizer.ggml.tokens"]
    for i, a in enumerate(attrs):
        if a & _CONTROL and "unused" in tokens[i]:
            attrs[i] = a | _UNUSED
    return attrs


def _as_ints(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


def _token_id(metadata: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    """A `tokenizer.ggml.<key>` id; out-of-range ids (in the file or as defaults) count as absent."""
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is not None and 0 <= int(value) < n:
        return int(value)
    return default if default is not None and 0 <= default < n else None
