"""SentencePiece-style tokenization (GGUF tokenizer.ggml.model = "llama"), matching llama.cpp's
llm_tokenizer_spm.

Spaces are written as U+2581 ("▁"), with one in front of text that starts the input or follows a
special token when the model asks for it (tokenizer.ggml.add_space_prefix). The text is cut into
characters and adjacent pairs whose concatenation is a token are merged, highest token score first
(leftmost on ties), until no pair is a token. A character left over that is not a token becomes one
<0xXX> token per UTF-8 byte (byte fallback).

llama.cpp merges over the whole text at once. We cut it into words first, before each "▁" whose
preceding character never precedes an inner "▁" in any token: no token can span such a cut, so each
word merges exactly as it would inside the whole text (the merge order within it is unchanged). Words
are then cached, so common ones cost one dict lookup.
"""

from __future__ import annotations

import heapq
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from localllm.errors import ModelFormatError
from localllm.text_table import TextTable
from localllm.tokenizer.base import Tokenizer

__all__ = ["SPMTokenizer"]

SPACE = "\u2581"  # "▁": SentencePiece's escaped space
_SPACE_UTF8 = SPACE.encode("utf-8")
_SHORT_TEXT = 12  # characters; below this a plain scan beats the heap (as in bpe.py)
_GLUE_CHUNK = 16384  # tokens joined at a time when looking for inner "▁"


class SPMTokenizer(Tokenizer):
    # llama.cpp's defaults for an SPM vocabulary whose GGUF lacks the keys.
    default_bos_id = 1
    default_eos_id = 2
    default_add_bos = True

    def __init__(self, metadata: Mapping[str, Any]):
        super().__init__(metadata)
        self.add_space_prefix: bool = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        self._scores = _read_scores(metadata, self.vocab_size)
        self._byte_ids = self._byte_fallback_ids()
        self._splitter: re.Pattern[str] | None = None  # built on first use: it scans the vocabulary

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """As llama.cpp's detokenize: with add_space_prefix, the first token loses one leading space
        (the one encode added). A leading BOS takes that turn, so text after BOS keeps its space."""
        ids = list(ids)
        if not (self.add_space_prefix and ids):
            return super().decode(ids, skip_special)
        first = self.token_bytes(ids[0], skip_special)
        if first.startswith(b" "):
            first = first[1:]
        data = first + b"".join(self.token_bytes(i, skip_special) for i in ids[1:])
        return data.decode("utf-8", errors="replace")

    def _tokenize_text(self, text: str, after_special: bool) -> list[int]:
        if self.add_space_prefix and after_special:
            text = " " + text
        if self._splitter is None:
            self._splitter = _word_splitter(self._tokens)
        return self._encode_words(self._splitter.split(text.replace(" ", SPACE)))

    def _word_ids(self, word: str) -> tuple[int, ...]:
        merge = _merge_short if len(word) < _SHORT_TEXT else _merge_heap
        return tuple(self._symbol_ids(merge(list(word), self._token_to_id, self._scores)))

    def _normal_token_bytes(self, token_id: int) -> bytes:
        return self._tokens.raw(token_id).replace(_SPACE_UTF8, b" ")

    def _symbol_ids(self, symbols: list[str]) -> list[int]:
        """Each merged symbol is a token; a leftover character that is not becomes its bytes."""
        ids: list[int] = []
        get = self._token_to_id.get
        for sym in symbols:
            tid = get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            for b in sym.encode("utf-8", errors="surrogatepass"):
                byte_id = self._byte_ids[b]
                # llama.cpp throws (out_of_range) when a vocabulary has no token for a byte; we drop it.
                if byte_id is not None:
                    ids.append(byte_id)
        return ids

    def _byte_fallback_ids(self) -> list[int | None]:
        """llama.cpp's byte_to_token: the <0xXX> token, else a token that is the byte itself."""
        ids: list[int | None] = []
        for b in range(256):
            tid = self._token_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self._token_to_id.get(chr(b))
            ids.append(tid)
        return ids


def _word_splitter(tokens: TextTable) -> re.Pattern[str]:
    """A pattern whose split() cuts text before each "▁" that no token can merge across: one whose
    preceding character never comes right before a "▁" inside a token (Gemma 3: only ">" does)."""
    glue: set[str] = set()
    nul = False
    for start in range(0, len(tokens), _GLUE_CHUNK):  # in chunks: the whole text is ~8 MiB for Gemma 3
        chunk = range(start, min(start + _GLUE_CHUNK, len(tokens)))
        joined = tokens.joined(chunk.start, chunk.stop, "\x00")
        # Drop each token's leading ▁ (it follows no character); a ▁ then left right after a separator
        # was its token's second character, following a ▁: keep ▁ as glue then.
        inner = joined.replace("\x00" + SPACE, "\x00")
        at = inner.find(SPACE)
        while at >= 0:  # few inner ▁ in real vocabularies: str.find beats a regex over the text
            glue.add(inner[at - 1])
            at = inner.find(SPACE, at + 1)
        nul = nul or joined.count("\x00") != len(chunk)
    if "\x00" in glue or nul:  # (a token with a NUL: be safe)
        glue.update((SPACE, "\x00"))
    if not glue:
        return re.compile(f"(?<=.)(?={SPACE})", re.S)
    return re.compile(f"(?<=[^{''.join(re.escape(c) for c in sorted(glue))}])(?={SPACE})", re.S)


def _read_scores(metadata: Mapping[str, Any], n: int) -> Sequence[float]:
    """Scores as float32 in an array.array: indexing gives the same Python floats as a list would
    (GGUF stores them as float32), at 4 bytes a token instead of 32 (Gemma 3: 8 -> 1 MiB)."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return array("f", bytes(4 * n))  # llama.cpp scores every token 0: ties then merge leftmost first
    if len(scores) < n:
        raise ModelFormatError("the model's token score list is shorter than its vocabulary.")
    if str(getattr(scores, "dtype", "")) == "float32":  # a native-order NumPy float32 array
        return array("f", scores[:n].tobytes())
    return [float(s) for s in scores[:n]]  # (not float32: keep every bit of the values given)


def _merge_short(parts: list[str], vocab: dict[str, int], scores: Sequence[float]) -> list[str]:
    """Repeatedly merge the best adjacent pair (highest score, leftmost on ties): O(n^2), for short n."""
    get = vocab.get
    while len(parts) > 1:
        best_score, best = 0.0, -1
        for i in range(len(parts) - 1):
            tid = get(parts[i] + parts[i + 1])
            if tid is not None and (best < 0 or scores[tid] > best_score):
                best_score, best = scores[tid], i
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _merge_heap(parts: list[str], vocab: dict[str, int], scores: Sequence[float]) -> list[str]:
    """The same merge order with a heap over a linked list of symbols (llama.cpp's algorithm).

    A queued pair is stale once either side has merged with something else: then a side is empty or
    their lengths no longer add up to the pair's (symbols only grow), exactly llama.cpp's check.
    """
    n = len(parts)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    get = vocab.get
    heap: list[tuple[float, int, int, int]] = []
    for i in range(n - 1):
        tid = get(parts[i] + parts[i + 1])
        if tid is not None:
            heap.append((-scores[tid], i, i + 1, 2))
    heapq.heapify(heap)
    push = heapq.heappush
    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = parts[left], parts[right]
        if not a or not b or len(a) + len(b) != size:
            continue
        merged = parts[left] = a + b
        parts[right] = ""
        after = nxt[left] = nxt[right]
        if after < n:
            prv[after] = left
            tid = get(merged + parts[after])
            if tid is not None:
                push(heap, (-scores[tid], left, after, len(merged) + len(parts[after])))
        before = prv[left]
        if before >= 0:
            tid = get(parts[before] + merged)
            if tid is not None:
                push(heap, (-scores[tid], before, left, len(parts[before]) + len(merged)))
    return [p for p in parts if p]
