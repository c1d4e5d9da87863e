"""Loop guard: notice a reply that repeats the same span of tokens over and over, and end it.

Small models decoding greedily fall into loops ("la femme au martyre, la femme au martyre, ...") that run
until the length limit.  For every period p up to MAX_SPAN the guard keeps how many of the latest tokens
equal the token p places before them; the reply is a loop once the latest tokens are one span repeated
at least MIN_REPEATS times and over at least MIN_TOKENS tokens.  That is a handful of numpy operations on
MAX_SPAN-long arrays per token, whatever the reply's length.
"""

from __future__ import annotations

import numpy as np

MAX_SPAN = 64  # longest repeated span looked for, in tokens (a long sentence)
MIN_REPEATS = 4  # a span seen this many times in a row ...
MIN_TOKENS = 128  # ... over at least this many tokens (short spans must repeat more often)

_SPANS = np.arange(1, MAX_SPAN + 1)
# For period p the latest n tokens repeat a p-token span once the last n - p of them match p back.
_NEEDED = np.maximum(MIN_REPEATS * _SPANS, MIN_TOKENS) - _SPANS


class LoopGuard:
    """Per-request state; `add` every generated token, in order."""

    __slots__ = ("_recent", "_runs")

    def __init__(self) -> None:
        self._recent = np.full(MAX_SPAN, -1, dtype=np.int64)  # _recent[k]: the token k + 1 places back
        self._runs = np.zeros(MAX_SPAN, dtype=np.int64)  # _runs[p - 1]: latest tokens equal to p back

    def add(self, token_id: int) -> int:
        """The length of the span the reply now loops on, or 0."""
        match = self._recent == token_id
        self._runs = np.where(match, self._runs + 1, 0)
        self._recent[1:] = self._recent[:-1]
        self._recent[0] = token_id
        looping = np.flatnonzero(self._runs >= _NEEDED)
        return int(looping[0]) + 1 if looping.size else 0


def loop_notice(generated_tokens: int) -> str:
    """What run and chat print when the guard ended a reply."""
    return (
        f"[stopped after {generated_tokens} tokens: the reply kept repeating itself; "
        "--no-loop-guard lets it run]"
    )
