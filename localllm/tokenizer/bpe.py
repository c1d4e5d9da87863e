"""Byte-level BPE (GGUF tokenizer.ggml.model = "gpt2"), matching llama.cpp's llm_tokenizer_bpe.

Text is cut into words by the pre-tokenizer, each word's UTF-8 bytes are written as GPT-2's
byte-level characters, and merges are applied lowest rank first (leftmost on ties) until none
applies. Results are cached per word, so common words cost one dict lookup.

Gemma 4's "gemma4" model is the same merging over SentencePiece-style text instead (Gemma4Tokenizer).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from localllm.errors import ModelFormatError
from localllm.tokenizer.base import Tokenizer
from localllm.tokenizer.pretokenizers import get_pretokenizer

_SHORT_WORD = 12  # symbols; below this a plain scan beats the heap (measured)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# str.translate tables between latin-1 text (one char per byte) and GPT-2 symbols.
_LATIN1_TO_SYMBOL = dict(byte_to_unicode())
_SYMBOL_TO_LATIN1 = {ord(c): b for b, c in byte_to_unicode().items()}
_SYMBOLS = frozenset(byte_to_unicode().values())


def byte_encode(word: str) -> str:
    """The word's UTF-8 bytes, one GPT-2 symbol per byte."""
    return word.encode("utf-8", errors="surrogatepass").decode("latin-1").translate(_LATIN1_TO_SYMBOL)


class BPETokenizer(Tokenizer):
    default_add_bos = False

    def __init__(self, metadata: Mapping[str, Any]):
        self.pre = get_pretokenizer(metadata.get("tokenizer.ggml.pre"))
        self.default_add_bos = self.pre.add_bos
        super().__init__(metadata)
        self._ranks = _read_merges(metadata)

    def _tokenize_text(self, text: str, after_special: bool) -> list[int]:
        return self._encode_words(self.pre.split(text))

    def _normal_token_bytes(self, token_id: int) -> bytes:
        text = self._tokens[token_id]
        raw = text.translate(_SYMBOL_TO_LATIN1)
        if all(c in _SYMBOLS for c in text):
            return raw.encode("latin-1")
        # Not a byte-level token (a converter quirk): its own text is the best answer.
        return b"".join(
            c.translate(_SYMBOL_TO_LATIN1).encode("latin-1") if c in _SYMBOLS else c.encode("utf-8")
            for c in text
        )

    def _word_ids(self, word: str) -> tuple[int, ...]:
        symbols = byte_encode(word)
        if self.pre.ignore_merges and symbols in self._token_to_id:
            return (self._token_to_id[symbols],)
        merge = _merge_short if len(symbols) < _SHORT_WORD else _merge_heap
        return tuple(self._symbol_ids(merge(list(symbols), self._ranks)))

    def _symbol_ids(self, parts: list[str]) -> list[int]:
        ids: list[int] = []
        for part in parts:
            tid = self._token_to_id.get(part)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp falls back to one token per byte of the symbol's text, dropping unknown ones.
            ids.extend(self._token_to_id[c] for c in part if c in self._token_to_id and ord(c) < 128)
        return ids


_LINES = re.compile(r"[^\n]+|\n+")  # llama.cpp's gemma4 pre-tokenizer: lines and runs of newlines
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


class Gemma4Tokenizer(Tokenizer):
    """tokenizer.ggml.model = "gemma4", as llama.cpp runs it: spaces written as "▁", the text cut only
    into lines and newline runs (a run that is a token stays whole), merges over UTF-8 characters,
    and an unknown symbol spelled with "<0xAB>" byte tokens. BOS is always added (llama.cpp overrides
    a file's add_bos_token = false for Gemma 4)."""

    default_add_bos = True

    def __init__(self, metadata: Mapping[str, Any]):
        super().__init__(metadata)
        if self.bos_id is None:
            raise ModelFormatError("a gemma4 tokenizer needs a BOS token (tokenizer.ggml.bos_token_id).")
        self.add_bos = True
        self._ranks = _read_merges(metadata)

    def _tokenize_text(self, text: str, after_special: bool) -> list[int]:
        return self._encode_words(_LINES.findall(text.replace(" ", _SPACE)))

    def _normal_token_bytes(self, token_id: int) -> bytes:
        return self._tokens[token_id].replace(_SPACE, " ").encode("utf-8")

    def _word_ids(self, word: str) -> tuple[int, ...]:
        if word[0] == "\n" and word in self._token_to_id:
            return (self._token_to_id[word],)
        merge = _merge_short if len(word) < _SHORT_WORD else _merge_heap
        ids: list[int] = []
        for part in merge(list(word), self._ranks):
            tid = self._token_to_id.get(part)
            if tid is not None:
                ids.append(tid)
                continue
            names = (f"<0x{b:02X}>" for b in part.encode("utf-8", errors="surrogatepass"))
            ids.extend(self._token_to_id[n] for n in names if n in self._token_to_id)
        return tuple(ids)


def _read_merges(metadata: Mapping[str, Any]) -> dict[str, int]:
    """Merge ranks keyed by the merge's own text "left right" (the metadata's strings, not copies).

    llama.cpp splits a merge at the first space after its first character. A pair looked up here
    comes from byte-level symbols, which never hold a space (GPT-2 writes it as "Ġ"), so the text
    left + " " + right names exactly the merge that splits into (left, right): the same matches as
    (left, right) tuple keys, without a tuple and two new strings per merge (far less memory)."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelFormatError("the BPE model file has no merges (tokenizer.ggml.merges).")
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        if merge.find(" ", 1) > 0:
            ranks.setdefault(merge, rank)
    return ranks


def _merge_short(parts: list[str], ranks: dict[str, int]) -> list[str]:
    """Repeatedly merge the lowest-ranked adjacent pair (leftmost on ties): O(n^2), fast for short n.
    ranks: _read_merges's, keyed "left right"; parts never hold a space."""
    get = ranks.get
    while len(parts) > 1:
        best_rank, best = None, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + " " + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best = rank, i
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _merge_heap(parts: list[str], ranks: dict[str, int]) -> list[str]:
    """The same merge order with a heap over a linked list (llama.cpp's algorithm): O(n log n)."""
    n = len(parts)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    heap: list[tuple[int, int, str, str]] = []

    def push(left: int) -> None:
        right = nxt[left] if left >= 0 else n
        if left >= 0 and right < n:
            rank = ranks.get(parts[left] + " " + parts[right])
            if rank is not None:
                heapq.heappush(heap, (rank, left, parts[left], parts[right]))

    for i in range(n - 1):
        push(i)
    while heap:
        _, left, ltext, rtext = heapq.heappop(heap)
        right = nxt[left]
        if not parts[left] or right >= n or parts[left] != ltext or parts[right] != rtext:
            continue  # stale: one side has merged since this pair was queued
        parts[left], parts[right] = ltext + rtext, ""
        nxt[left] = nxt[right]
        if nxt[right] < n:
            prv[nxt[right]] = left
        push(prv[left])
        push(left)
    return [p for p in parts if p]
