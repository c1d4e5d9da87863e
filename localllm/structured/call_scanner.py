"""CallScanner: reads a tool call's JSON object as it is written, character by character, to find the
function's name as soon as it is complete and the raw text of its arguments object as far as it has
arrived. The stream sends those argument characters as they come (OpenAI streams `arguments` in
pieces), and the final parse takes the same raw text, so what a client assembles from the deltas is
exactly the `arguments` of the whole reply.
"""

from __future__ import annotations

import json

ARGS_KEYS = ("arguments", "parameters")  # Hermes/Qwen/Mistral write "arguments", Llama 3 "parameters"


class CallScanner:
    """Feed it the call's text (leading whitespace allowed, then `{`); it never looks back."""

    def __init__(self, args_key: str = "arguments") -> None:
        self.args_keys = (args_key, *(k for k in ARGS_KEYS if k != args_key))  # in the parser's order
        self.text = ""
        self.depth = 0  # open objects/arrays
        self.done = False  # the call object closed
        self.end = 0  # where in `text` it closed (what follows is not the call's)
        self.failed = False  # not a JSON object
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._expect = "open"  # at depth 1: key, colon, value, string value, literal, after, nested
        self._key: str | None = None
        self.values: dict[str, list[int]] = {}  # top-level key -> [start, end (-1 while open)]

    def feed(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            if self.done or self.failed:
                return
            self._char(i, self.text[i])

    # -- what the scan has found --------------------------------------------------------------------

    @property
    def name(self) -> str | None:
        """The `name` member once its string is complete."""
        span = self.values.get("name")
        if span is None or span[1] < 0 or self.text[span[0]] != '"':
            return None
        value = json.loads(self.text[span[0] : span[1]])
        return value if isinstance(value, str) else None

    def arguments(self) -> tuple[str, bool] | None:
        """The raw text of the arguments object so far and whether it is complete; None while no
        arguments object has started (or they are not an object: a JSON string, say)."""
        for key in self.args_keys:
            span = self.values.get(key)
            if span is not None:
                if self.text[span[0]] != "{":
                    return None
                return self.text[span[0] : span[1] if span[1] >= 0 else len(self.text)], span[1] >= 0
        return None

    # -- the scan -----------------------------------------------------------------------------------

    def _char(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self.depth == 1:
                    self._string_end(i)
            return
        if self.depth == 1:
            self._top(i, c)
        elif c.isspace():
            return
        elif self.depth == 0:
            self.depth, self._expect, self.failed = 1, "key", c != "{"
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._close_value(i + 1)

    def _top(self, i: int, c: str) -> None:
        """A character directly inside the call object."""
        expect = self._expect
        if expect == "literal" and (c.isspace() or c in ",}"):
            self._close_value(i)
            expect = self._expect
        if c.isspace():
            return
        if expect == "key" and c == '"':
            self._in_string, self._string_start = True, i
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "value":
            self._value_start(i, c)
        elif expect in ("key", "after") and c == "}":
            self.depth, self.done, self.end = 0, True, i + 1
        elif expect == "after" and c == ",":
            self._expect = "key"
        elif expect != "literal":
            self.failed = True

    def _value_start(self, i: int, c: str) -> None:
        if self._key is not None and self._key not in self.values:
            self.values[self._key] = [i, -1]
        if c == '"':
            self._in_string, self._expect = True, "string value"
        elif c in "{[":
            self.depth, self._expect = 2, "nested"
        else:
            self._expect = "literal"

    def _string_end(self, i: int) -> None:
        if self._expect == "key":
            self._key = json.loads(self.text[self._string_start : i + 1])
            self._expect = "colon"
        else:
            self._close_value(i + 1)

    def _close_value(self, end: int) -> None:
        span = self.values.get(self._key) if self._key is not None else None
        if span is not None and span[1] < 0:
            span[1] = end
        self._expect = "after"
