"""Per-request text output: incremental UTF-8 decoding plus stop strings held back while they may match."""

from __future__ import annotations

from typing import Any


class StopChecker:
    """Holds back the tail of the text that could still turn into a stop string."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string that matched or None)."""
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, None
        hit = self._first_match()
        if hit is not None:
            index, stop = hit
            out, self.pending = self.pending[:index], ""
            return out, stop
        keep = self._partial_suffix()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _first_match(self) -> tuple[int, str] | None:
        hits = [(self.pending.find(s), s) for s in self.stop if s in self.pending]
        return min(hits) if hits else None

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best


class Detokenizer:
    """A request's tokens to printable text deltas, with its stop strings applied."""

    def __init__(self, tokenizer: Any, stop: list[str], skip_special: bool = True):
        from localllm.tokenizer.stream import IncrementalDecoder

        self.decoder = IncrementalDecoder(tokenizer, skip_special=skip_special)
        self.stop = StopChecker(stop)

    def add(self, token_id: int) -> tuple[str, str | None]:
        return self.stop.feed(self.decoder.add(token_id))

    def finish(self) -> str:
        """Whatever is held back, at the end of a request that did not stop on a string."""
        out, matched = self.stop.feed(self.decoder.flush())
        return out if matched else out + self.stop.flush()
