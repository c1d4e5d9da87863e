"""Thinking kept apart from the answer: which reasoning format a model writes, and the incremental
parsers that split its reply text into reasoning and content as it streams.

Two formats:
- think tags (Qwen3/3.5, DeepSeek-R1 distills, SmolLM3, ...): `<think>...</think>` (or another pair
  from TAG_PAIRS) around the reasoning; a template that opens the block in its generation prompt makes
  the reply start inside it.
- harmony (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`; `analysis` is reasoning,
  `final` (and `commentary` without a recipient) is content, and a message addressed
  `to=functions.NAME` is a tool call, written into the content as the Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` the server's tool parser reads.

The parsers take text as it is decoded and hold back only what may still turn into a marker, so a
tag split across tokens works and the deltas of a stream join to exactly the unstreamed split. The
engine (engine.py) runs one per request whose SamplingParams carry a ReasoningSpec, and forces the
spec's closing text when a reasoning budget is spent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

THINK, HARMONY = "think", "harmony"
# (open, close) tag pairs models think between, looked for in the chat template's text.
TAG_PAIRS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"))
# harmony's markers (special tokens in gpt-oss's vocabulary)
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_CONSTRAIN, H_RETURN, H_CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_CONSTRAIN, H_RETURN, H_CALL)
HARMONY_CLOSE = f"{H_END}{H_START}assistant{H_CHANNEL}final{H_MESSAGE}"  # analysis ends, the answer begins
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """How a request's reply is split: the format, its markers, and the reasoning budget (tokens of
    reasoning before `close` is forced; None: no limit)."""

    format: str  # THINK | HARMONY
    start: str = "<think>"
    end: str = "</think>"
    budget: int | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that must stay visible in the decoded text (special tokens are otherwise hidden)."""
        return HARMONY_MARKERS if self.format == HARMONY else (self.start, self.end)

    @property
    def close(self) -> str:
        """What ends the reasoning when the budget is spent: the model's own end marker(s)."""
        return HARMONY_CLOSE if self.format == HARMONY else self.end

    def parser(self) -> ReasoningParser:
        return HarmonyParser() if self.format == HARMONY else ThinkParser(self.start, self.end)

    def with_budget(self, budget: int | None) -> ReasoningSpec:
        """This spec with `budget` reasoning tokens (None or negative: no limit)."""
        limit = None if budget is None or budget < 0 else budget
        return ReasoningSpec(self.format, self.start, self.end, limit)


def detect_reasoning(template_source: str | None, special_tokens: Any = ()) -> ReasoningSpec | None:
    """The reasoning format a chat template teaches (None: the model does not think apart).
    `special_tokens`: the vocabulary's special token texts (harmony needs its markers there)."""
    source = template_source or ""
    if H_CHANNEL in source and H_MESSAGE in source and {H_CHANNEL, H_MESSAGE} <= set(special_tokens):
        return ReasoningSpec(HARMONY, H_CHANNEL, H_END)
    for start, end in TAG_PAIRS:
        if end in source or (start in source and end in special_tokens):
            return ReasoningSpec(THINK, start, end)
    return None


def with_reasoning(params: Any, template: Any, tokenizer: Any, budget: int | None = None) -> Any:
    """SamplingParams `params` reading a thinking model's reply apart (its reasoning out of the text),
    with `budget` reasoning tokens, when the chat `template` teaches a reasoning format: what `run`,
    `chat` and `LLM.chat` apply (the server: pipeline.reasoning_params). A constrained reply (a schema
    or grammar from its first token) is all answer."""
    import dataclasses

    source = template.source if template is not None else None
    spec = detect_reasoning(source, tokenizer.special_tokens)
    if spec is None or params.structured is not None:
        return params
    return dataclasses.replace(params, reasoning=spec.with_budget(budget))


class ReasoningParser(Protocol):
    in_reasoning: bool

    def prime(self, text: str) -> None:
        """The end of the prompt (after its last control token): where the reply starts."""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """What was held back, at the end of the reply (`cut`: not by its own end token)."""


def _held(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that starts one of `markers` (it may become one)."""
    for keep in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-keep:]
        if any(m.startswith(tail) for m in markers):
            return keep
    return 0


class ThinkParser:
    """Think tags. Reasoning is what lies between the tags (the block may be left open: a reply cut
    inside it is all reasoning); a stray end tag in the content is dropped. Whitespace around the
    reasoning and at the start of the content after it is trimmed, as the tags' own layout."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.in_reasoning = False
        self.buf = ""  # undecided text: a partial tag, or whitespace that may be trimmed
        self.trim = False  # at the start of a section: leading whitespace is dropped
        self.reasoned = False  # some reasoning went out

    def prime(self, text: str) -> None:
        self.in_reasoning = text.rfind(self.start) > text.rfind(self.end)
        self.trim = self.in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.trim:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.trim = False
            tag = self.end if self.in_reasoning else None
            at, tag = self._next_tag(tag)
            if at < 0:
                keep = self._keep()
                self._emit(self.buf[: len(self.buf) - keep], reasoning, content)
                self.buf = self.buf[len(self.buf) - keep :]
                break
            head = self.buf[:at]
            self._emit(head.rstrip() if self.in_reasoning else head, reasoning, content)
            self.buf = self.buf[at + len(tag) :]
            self.in_reasoning = tag == self.start
            self.trim = True
            if self.in_reasoning and self.reasoned:  # a second block, set apart from the first
                reasoning.append("\n\n")
        return "".join(reasoning), "".join(content)

    def _next_tag(self, only: str | None) -> tuple[int, str]:
        """The first tag in the buffer: the end tag inside reasoning; either outside (a stray end)."""
        if only is not None:
            return self.buf.find(only), only
        found = [(self.buf.find(t), t) for t in (self.start, self.end)]
        found = [f for f in found if f[0] >= 0]
        return min(found) if found else (-1, self.start)

    def _keep(self) -> int:
        """Held back: a partial tag, and inside reasoning the trailing whitespace (trimmed before
        the end tag, kept if more reasoning follows)."""
        keep = _held(self.buf, (self.end,) if self.in_reasoning else (self.start, self.end))
        if self.in_reasoning:
            body = self.buf[: len(self.buf) - keep]
            keep += len(body) - len(body.rstrip())
        return keep

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self.in_reasoning:
            self.reasoned = self.reasoned or bool(text)
            reasoning.append(text)
        else:
            content.append(text)

    def finish(self, cut: bool = False) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.in_reasoning:
            return rest.rstrip(), ""
        return "", rest


class HarmonyParser:
    """gpt-oss's harmony messages. A header (role, `<|channel|>NAME`, ` to=RECIPIENT`, `<|constrain|>`)
    runs to `<|message|>`; the body to `<|end|>` (or the end of the reply: `<|return|>` and `<|call|>`
    end the generation). A reply that opens with plain text, not a header, is all content."""

    def __init__(self) -> None:
        self.state = "header"  # header | body
        self.header = ""  # the current message's header text so far
        self.fresh = True  # no header of the reply itself read yet
        self.channel = ""
        self.call: str | None = None  # the function a commentary message calls
        self.call_body = ""  # the call's arguments text so far
        self.buf = ""
        self.reasoned = False  # some reasoning went out (the next analysis message is set apart)
        self.in_reasoning = False

    def prime(self, text: str) -> None:
        self.header = text.rsplit(H_START, 1)[-1]
        if H_MESSAGE in self.header:  # the prompt opened the message body itself
            head, _, body = self.header.partition(H_MESSAGE)
            self._open(head)
            self.fresh = False
            self.feed(body)

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        out: tuple[list[str], list[str]] = ([], [])
        while self.buf:
            if not (self._header(out) if self.state == "header" else self._body(out)):
                break
        return "".join(out[0]), "".join(out[1])

    def _header(self, out: tuple[list[str], list[str]]) -> bool:
        if self.fresh and self._plain_reply():
            self.fresh = False
            self._open(f"{H_CHANNEL}final")
            return True
        at = self.buf.find(H_MESSAGE)
        if at < 0:
            return False
        head, self.buf = self.header + self.buf[:at], self.buf[at + len(H_MESSAGE) :]
        self.fresh = False
        self._open(head, out)
        return True

    def _plain_reply(self) -> bool:
        """The reply's text starts with no header marker: a model writing plain text."""
        text = self.buf.lstrip(" ")
        heads = (H_CHANNEL, H_MESSAGE, H_CONSTRAIN, "to=")
        return bool(text) and not any(h.startswith(text[: len(h)]) for h in heads)

    def _open(self, head: str, out: tuple[list[str], list[str]] | None = None) -> None:
        """Start a message's body from its header text."""
        self.state, self.header = "body", ""
        words = head.replace(H_CHANNEL, " ").replace(H_CONSTRAIN, " ").split()
        recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        after = head.split(H_CHANNEL, 1)[1].split() if H_CHANNEL in head else []
        self.channel = after[0] if after else ""
        self.call = recipient.removeprefix("functions.") if recipient else None
        self.call_body = ""
        self.in_reasoning = self.call is None and self.channel == "analysis"
        if out is None:
            return
        if self.call is not None:
            out[1].append(f'{TOOL_OPEN}{{"name": {json.dumps(self.call)}, "arguments": ')
        elif self.in_reasoning and self.reasoned:
            out[0].append("\n\n")

    def _body(self, out: tuple[list[str], list[str]]) -> bool:
        found = (self.buf.find(m) for m in (H_END, H_START, H_RETURN, H_CALL))
        at = min((i for i in found if i >= 0), default=-1)
        if at < 0:
            keep = _held(self.buf, HARMONY_MARKERS)
            self._write(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._write(self.buf[:at], out)
        self._close(out)
        marker = next(m for m in HARMONY_MARKERS if self.buf.startswith(m, at))
        self.buf = self.buf[at + len(marker) :]
        self.state = "header"  # `<|start|>assistant...` follows `<|end|>`: the next header
        return True

    def _write(self, text: str, out: tuple[list[str], list[str]]) -> None:
        if not text:
            return
        if self.call is not None:
            self.call_body += text
            out[1].append(text)
        elif self.in_reasoning:
            self.reasoned = True
            out[0].append(text)
        else:
            out[1].append(text)

    def _close(self, out: tuple[list[str], list[str]]) -> None:
        if self.call is not None:
            out[1].append(("" if self.call_body.strip() else "{}") + "}" + TOOL_CLOSE)
            self.call = None
        self.in_reasoning = False

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """A call `cut` short (by a length limit, not `<|call|>`) is left open unless its arguments are
        whole: closing it would make partial ones look whole to a stream's reader (the tool parser
        drops it)."""
        out: tuple[list[str], list[str]] = ([], [])
        if self.state == "body":  # a header cut short is dropped: it is markup, not text
            self._write(self.buf, out)
            if cut and not _whole_json(self.call_body):
                self.call = None
            self._close(out)
        self.buf = ""
        return "".join(out[0]), "".join(out[1])


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass
class ReasoningState:
    """One request's parser, its count of reasoning tokens, and the tokens that close the reasoning
    when the budget is spent (the engine forces them)."""

    spec: ReasoningSpec
    parser: ReasoningParser
    close_ids: list[int]
    tokens: int = 0
    forced: bool = False  # the close was forced once (never twice)

    @classmethod
    def start(cls, spec: ReasoningSpec, tokenizer: Any, prompt_ids: Sequence[int]) -> ReasoningState:
        parser = spec.parser()
        parser.prime(prompt_tail(tokenizer, prompt_ids, marker_ids(spec, tokenizer)))
        close = tokenizer.encode(spec.close, add_special=False, parse_special=True)
        return cls(spec, parser, close)

    def split(self, text: str, count: bool, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a token's text; `count`: it is a generated token (reasoning ones are
        counted against the budget); `final`: the reply ends here."""
        inside = self.parser.in_reasoning
        reasoning, content = self.parser.feed(text)
        if count and inside and self.parser.in_reasoning:  # the markers themselves are not counted
            self.tokens += 1
        if final:  # ending on a generated token, not an end-of-text one: the reply was cut
            more = self.parser.finish(cut=count)
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def due(self) -> bool:
        """True once, when the budget is spent and the reply is still inside its reasoning: the
        caller then forces `close_ids`."""
        budget = self.spec.budget
        if self.forced or budget is None or self.tokens < budget or not self.parser.in_reasoning:
            return False
        self.forced = True
        return True


def marker_ids(spec: ReasoningSpec, tokenizer: Any) -> frozenset[int]:
    """The vocabulary's tokens for the spec's markers: decoded as text even when special."""
    found = (tokenizer.special_tokens.get(m) for m in spec.markers)
    return frozenset(i for i in found if i is not None)


def prompt_tail(tokenizer: Any, prompt_ids: Sequence[int], keep: frozenset[int], limit: int = 64) -> str:
    """The prompt's text after its last control token that is not a marker (where the assistant's
    turn begins: `assistant\\n<think>\\n` for a template that opens the block), markers visible."""
    tail: list[int] = []
    for tid in reversed(prompt_ids[-limit:]):
        if tid not in keep and tokenizer.is_control(tid):
            break
        tail.append(tid)
    data = b"".join(tokenizer.token_bytes(t, skip_special=t not in keep) for t in reversed(tail))
    return data.decode("utf-8", errors="replace")
