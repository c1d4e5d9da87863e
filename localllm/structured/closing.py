"""Ending a constrained reply as a complete document instead of cutting it.

When the loop guard sees a constrained reply repeat itself, a cut would leave invalid JSON. Instead the
sequence's mask narrows to closing tokens wherever the grammar allows one: inside a string, a quote
(optionally followed by `}` / `]`); elsewhere, tokens made only of `}` and `]`, else a comma (it ends
a number and moves on to the next required key). Where the grammar allows none of them, the model goes
on as before, under the grammar.

When the token budget (max_tokens, the context) runs short, `closing_token` is the shortest way to the
document's end, one token at a time (the same closers, then the shortest whole values, else the longest
token the grammar allows: forced text such as a required key goes fastest in long tokens). Following
it from a state counts the tokens the document still needs at least; the model's own token is replaced
by it only when taking the model's would leave fewer tokens than that (matcher.Constraint.steer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

_QUOTE = re.compile(rb'"[\]}]*')
_CLOSE = re.compile(rb"[\]}]+")
_COMMA = re.compile(rb", ?")
_SHORT = re.compile(rb' ?(""|-?[0-9]|null|true|false|\[\]|\{\})')  # whole values in one token
_QUOTE_ON = re.compile(rb'"[\]}]*, ?')  # a string's end, then a comma: on to the next required key
_CLOSE_ON = re.compile(rb"[\]}]+, ?")


class Closers:
    """The vocabulary's closing tokens, as bool arrays over the logits (built once per tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.quote = np.zeros(vocab_size, dtype=bool)
        self.close = np.zeros(vocab_size, dtype=bool)
        self.comma = np.zeros(vocab_size, dtype=bool)
        self.short = np.zeros(vocab_size, dtype=bool)
        self.quote_on = np.zeros(vocab_size, dtype=bool)
        self.close_on = np.zeros(vocab_size, dtype=bool)
        self.lengths = np.zeros(vocab_size, dtype=np.int32)  # bytes per token (control tokens: 0)
        for i in range(min(vocab_size, tokenizer.vocab_size)):
            if tokenizer.is_control(i):
                continue
            data = tokenizer.token_bytes(i)
            self.quote[i] = _QUOTE.fullmatch(data) is not None
            self.close[i] = _CLOSE.fullmatch(data) is not None
            self.comma[i] = _COMMA.fullmatch(data) is not None
            self.short[i] = _SHORT.fullmatch(data) is not None
            self.quote_on[i] = _QUOTE_ON.fullmatch(data) is not None
            self.close_on[i] = _CLOSE_ON.fullmatch(data) is not None
            self.lengths[i] = len(data)


class StringState:
    """Whether the JSON written so far is inside a string (unescaped quotes toggle it), and how many
    objects and arrays are open."""

    def __init__(self) -> None:
        self.inside = False
        self.depth = 0
        self._escaped = False

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self._escaped:
                self._escaped = False
            elif byte == 0x5C and self.inside:  # backslash
                self._escaped = True
            elif byte == 0x22:  # quote
                self.inside = not self.inside
            elif not self.inside and byte in b"{[":
                self.depth += 1
            elif not self.inside and byte in b"}]":
                self.depth = max(self.depth - 1, 0)

    def copy(self) -> StringState:
        other = StringState()
        other.inside, other.depth, other._escaped = self.inside, self.depth, self._escaped
        return other


def narrow(allowed: np.ndarray, closers: Closers, inside_string: bool) -> np.ndarray:
    """`allowed` restricted to the first kind of closing token the grammar allows, if any."""
    for wanted in (closers.quote,) if inside_string else (closers.close, closers.comma):
        narrowed = allowed & wanted[: allowed.shape[0]]
        if narrowed.any():
            return narrowed
    return allowed


def closing_token(
    allowed: np.ndarray, closers: Closers, inside_string: bool, closes_after: Callable[[int], bool]
) -> int | None:
    """The next token of the shortest way to the document's end: the longest closer the grammar allows
    (it closes the most; one that also writes a comma saves a token where the grammar wants one next,
    that is where `closes_after(closer)` says no bracket may follow it), else the longest whole value,
    else the longest token allowed at all."""
    lengths = closers.lengths
    if inside_string:
        kinds = ((closers.quote, closers.quote_on),)
    else:
        kinds = ((closers.close, closers.close_on), (closers.comma, None), (closers.short, None))
    for pure, onward in kinds:
        best = _longest(allowed, pure, lengths)
        ahead = _longest(allowed, onward, lengths) if onward is not None else None
        if ahead is not None and (best is None or not closes_after(best)):
            best = ahead
        if best is not None:
            return best
    text = _longest(allowed, lengths > 0, lengths)
    return text if text is not None else _longest(allowed, np.ones_like(allowed), lengths)  # a marker


def _longest(allowed: np.ndarray, wanted: np.ndarray, lengths: np.ndarray) -> int | None:
    """The longest token both allowed and wanted (None: none is)."""
    n = min(allowed.shape[0], wanted.shape[0])
    ids = np.flatnonzero(allowed[:n] & wanted[:n])
    if not ids.size:
        return None
    return int(ids[np.argmax(lengths[ids])])
