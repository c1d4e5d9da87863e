"""Text -> token id for a tokenizer, over the vocabulary's `TextTable`, without a dict of it all.

A dict from every token text to its id costs several times the vocabulary's blob (its table plus the
str keys); the table's hash buckets cost a small fraction of that. Lookups that tokenization repeats
(the same pair of symbols in many words) are answered by a bounded dict of recent results, so the hot
path stays one C dict lookup.
"""

from __future__ import annotations

from localllm.text_table import TextTable

__all__ = ["TokenIndex"]

_CACHE_LIMIT = 1 << 15  # lookups remembered (hits and misses); cleared when full


class _Recent(dict):
    """text -> id or None; a text not seen yet is looked up in the table (and remembered)."""

    __slots__ = ("table",)

    def __missing__(self, text: str) -> int | None:
        tid = self.table.find(text)
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        self[text] = tid
        return tid


class TokenIndex:
    """The first id of each text (as a dict built backwards over the vocabulary would give)."""

    def __init__(self, table: TextTable) -> None:
        self.table = table
        table.build_index()
        recent = _Recent()
        recent.table = table
        # `get(text)` is the hot path of tokenization: a bound dict.__getitem__ (None for no token)
        self.get = recent.__getitem__

    def ids_of(self, text: str) -> list[int]:
        """Every id whose text is `text`, ascending."""
        return self.table.ids_of(text)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self.get(text) is not None

    def __getitem__(self, text: str) -> int:
        tid = self.get(text)
        if tid is None:
            raise KeyError(text)
        return tid

    def __len__(self) -> int:
        return len(self.table)
