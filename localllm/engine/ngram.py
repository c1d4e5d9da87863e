"""Prompt-lookup drafting: guess the next tokens by finding the sequence's latest n-gram earlier in its own
prompt and output, and proposing what followed it there (no second model; pays where answers copy their
prompt: code edits, summaries, retrieval)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import numpy as np

NGRAM_MAX = 4  # longest suffix looked up first: a longer match predicts better
NGRAM_MIN = 2  # a single repeated token says too little to be worth a verify row
LOOKBACK = 4096  # tokens searched: bounds the per-step cost on long contexts


def propose_ngram(
    token_ids: SequenceLike[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (n from n_max down to n_min) of token_ids; [] when no suffix recurs."""
    if k <= 0 or len(token_ids) <= n_min:
        return []
    tokens = np.asarray(token_ids[-LOOKBACK:], dtype=np.int64)
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        start = _last_match(tokens, n)
        if start >= 0:
            follow = tokens[start + n : start + n + k]
            return follow.tolist()
    return []


def _last_match(tokens: np.ndarray, n: int) -> int:
    """Start of the latest window tokens[i:i+n] equal to the last n tokens, other than the suffix itself
    (windows end before the last token, so at least one token follows each)."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else -1
