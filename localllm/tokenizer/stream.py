"""Streaming detokenization: text as tokens arrive, never printing half a UTF-8 character.

A byte-level BPE token can end in the middle of a multi-byte character (an emoji is often two
or three tokens). The incremental UTF-8 decoder holds such a tail back until the rest arrives,
and turns bytes that can no longer form a character into U+FFFD as soon as that is certain.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes: ...


class IncrementalDecoder:
    """Feed token ids one at a time; get back the text that became printable."""

    def __init__(self, tokenizer: _TokenBytes, skip_special: bool = True, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.keep = keep  # special tokens shown even with skip_special (a reasoning format's markers)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The newly printable text after `token_id` (often "", mid-character)."""
        skip = self.skip_special and token_id not in self.keep
        return self._utf8.decode(self.tokenizer.token_bytes(token_id, skip))

    def flush(self) -> str:
        """What is still held back at the end of the stream (an incomplete character -> U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    def reset(self) -> None:
        self._utf8.reset()
