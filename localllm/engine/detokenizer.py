"""Per-request text output: incremental UTF-8 decoding plus stop strings held back while they may match."""

from __future__ import annotations

from typing import Any


class StopChecker:
    """Holds back the tail of the text that could still turn into a stop string.

    An Aho-Corasick automaton over the stop strings: each character fed costs O(1) amortized, whatever
    the number and length of the stops (the old suffix scan cost stops x pending^2 a token: 830 CPU-s
    for one request with 1,800 long stops). The automaton's state is the longest suffix of the text that
    begins a stop string: exactly what must be held back."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.pending = ""
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._ends: list[tuple[str, ...]] = [()]  # the stops ending at a node, its suffix links' included
        for s in stop:
            self._insert(s)
        self._link()
        self._state = 0

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._ends.append(())
            node = nxt
        self._ends[node] = (*self._ends[node], stop)

    def _link(self) -> None:
        """Suffix (failure) links, breadth first, and each node's stops merged with its link's."""
        queue = list(self._goto[0].values())
        for node in queue:  # grows while iterated: a breadth-first walk
            for ch, child in self._goto[node].items():
                self._fail[child] = self._next(self._fail[node], ch) if node else 0
                self._ends[child] = (*self._ends[child], *self._ends[self._fail[child]])
                queue.append(child)

    def _next(self, node: int, ch: str) -> int:
        while node and ch not in self._goto[node]:
            node = self._fail[node]
        return self._goto[node].get(ch, 0)

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string that matched or None)."""
        base = len(self.pending)
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, None
        hit = None  # (start in pending, stop): the earliest-starting stop in this text wins
        for i, ch in enumerate(text):
            self._state = self._next(self._state, ch)
            for stop in self._ends[self._state]:
                hit = min(hit or (base + i + 1 - len(stop), stop), (base + i + 1 - len(stop), stop))
        if hit is not None:
            out, self.pending, self._state = self.pending[: hit[0]], "", 0
            return out, hit[1]
        keep = self._depth[self._state]
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, None

    def flush(self) -> str:
        out, self.pending, self._state = self.pending, "", 0
        return out


class Detokenizer:
    """A request's tokens to printable text deltas, with its stop strings applied."""

    def __init__(
        self, tokenizer: Any, stop: list[str], skip_special: bool = True, keep: frozenset[int] = frozenset()
    ):
        from localllm.tokenizer.stream import IncrementalDecoder

        self.decoder = IncrementalDecoder(tokenizer, skip_special=skip_special, keep=keep)
        self.stop = StopChecker(stop)

    def add(self, token_id: int) -> tuple[str, str | None]:
        return self.stop.feed(self.decoder.add(token_id))

    def finish(self) -> str:
        """Whatever is held back, at the end of a request that did not stop on a string."""
        out, matched = self.stop.feed(self.decoder.flush())
        return out if matched else out + self.stop.flush()
