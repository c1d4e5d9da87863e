"""A streamed chat reply with tools, as OpenAI streams it: content deltas until a call starts, then per
call a first delta with its index, id, type and name (arguments ""), then deltas that append pieces of
its `arguments` text as the model writes them, and a final chunk whose finish_reason is "tool_calls"
("length" when a length limit cut the reply: a call it cut stops where it was).

A call starts at the family's marker (`<tool_call>`, `<|python_tag|>`), or, when the reply itself opens
with a JSON object (a bare call, as small models write, or a forced Llama 3 call), once that object's
`name` names a given function. Each call's JSON is read by a CallScanner, the same reader the final
parse takes the arguments text from, so the pieces assemble to exactly the non-streamed `arguments`.
Mistral's `[TOOL_CALLS][...]` list is sent whole at the end.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localllm.engine.output import StepOutput
from localllm.server.replies import cut_short, finish_reason
from localllm.structured.call_scanner import ARGS_KEYS, CallScanner
from localllm.structured.tools import maybe_bare_call, new_call_id

if TYPE_CHECKING:
    from localllm.server.tool_calls import ToolPlan

_FENCE_OPEN = re.compile(r"\s*```(?:json)?[ \t]*\n?")


@dataclass
class LiveCall:
    """One call being streamed: its scanner over the call's JSON, from `start` in the reply's text."""

    start: int
    scanner: CallScanner
    index: int = -1  # its tool_calls index, given when it is named
    id: str = field(default_factory=new_call_id)
    named: bool = False  # the first delta (id, type, name) has gone out
    args_sent: str = ""


@dataclass
class ToolStream:
    plan: ToolPlan
    chunks: Any  # streaming.ChunkBuilder, or anything with chat_delta(index, delta, finish)
    index: int = 0  # the choice streamed (n > 1: one ToolStream per choice)
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    mode: str = "bare"  # bare (the reply may open with a call object) | content | calls | whole
    pos: int = 0  # calls mode: where the search for the next call goes on
    calls: list[LiveCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plan.choice != "auto":  # a forced call: all of the reply is the call
            self.mode = "whole" if self.plan.family.name == "mistral" else "calls"

    def chat_output(self, out: StepOutput) -> Iterator[bytes]:
        if out.reasoning:  # thinking comes before any call, and is never parsed for one
            yield self._chunk({"reasoning_content": out.reasoning})
        self.text += out.text
        yield from self._advance()
        if out.finished:
            yield from self._finish(out)

    # -- as the text arrives ------------------------------------------------------------------------

    def _advance(self) -> Iterator[bytes]:
        if self.mode == "bare":
            yield from self._bare()
        if self.mode == "content":
            yield from self._content(self._safe_end())
        if self.mode == "calls":
            yield from self._scan_calls()

    def _bare(self) -> Iterator[bytes]:
        """A reply opening with `{` (or a ```json fence): a call once its name is one of the functions,
        plain content once it cannot be one."""
        if not maybe_bare_call(self.text):
            self.mode = "content"
            return
        start = 0
        if self.text.lstrip().startswith("`"):
            if "\n" not in self.text.lstrip():
                return  # the fence's first line is not complete yet
            fence = _FENCE_OPEN.match(self.text)
            if fence is None:
                self.mode = "content"
                return
            start = fence.end()
        probe = CallScanner(self.plan.family.args_key)
        probe.feed(self.text[start:])
        names = {f["name"] for f in self.plan.functions}
        known = {"name", *ARGS_KEYS}
        if probe.name in names:
            self.mode = "calls"
            self.calls.append(LiveCall(start, CallScanner(self.plan.family.args_key)))
            yield from self._scan_calls()
        elif probe.failed or probe.done or probe.name is not None or set(probe.values) - known:
            self.mode = "content"

    def _safe_end(self) -> int:
        """How far content can go: up to a call marker (then calls), or short of a partial marker."""
        marker = self.plan.family.start
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.mode = "whole" if self.plan.family.name == "mistral" else "calls"
            self.pos = at
            return at
        for keep in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if marker.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def _scan_calls(self) -> Iterator[bytes]:
        while True:
            live = self.calls[-1] if self.calls else None
            if live is not None and not live.scanner.done:
                live.scanner.feed(self.text[live.start + len(live.scanner.text) :])
                yield from self._deltas(live)
                if not live.scanner.done:  # still coming, or not a JSON object: the end's parse decides
                    return
                self.pos = live.start + live.scanner.end
            if any(c.named for c in self.calls) and not self.plan.parallel:
                return
            start = self._next_call()
            if start is None:
                return
            self.calls.append(LiveCall(start, CallScanner(self.plan.family.args_key)))

    def _next_call(self) -> int | None:
        """Where the next call's JSON starts (after its marker, if the family has one), if it has."""
        rest = self.text[self.pos :]
        marker = self.plan.family.start
        if self.plan.family.parsed_as == "hermes":
            at = rest.find(marker)
            return None if at < 0 else self.pos + at + len(marker)
        body = rest.lstrip().removeprefix(marker).lstrip(" \t\n;")  # llama3: `;` between calls
        return self.pos + len(rest) - len(body) if body.startswith("{") else None

    def _deltas(self, live: LiveCall) -> Iterator[bytes]:
        """The call's first delta once its name is known, then its arguments text as it grows."""
        if not live.named:
            if live.scanner.name is None:
                return
            live.named, live.index = True, sum(c.named for c in self.calls)
            yield self._head(live.index, live.id, live.scanner.name)
        found = live.scanner.arguments()
        if found is not None and len(found[0]) > len(live.args_sent):
            piece = found[0][len(live.args_sent) :]
            live.args_sent = found[0]
            yield self._arguments(live.index, piece)

    # -- the end ------------------------------------------------------------------------------------

    def _finish(self, out: StepOutput) -> Iterator[bytes]:
        """The calls not yet streamed whole, then the final chunk. A reply cut by a length limit ends
        with "length": a call it was writing gets no more deltas, and held-back text of one never goes
        out as content."""
        cut = cut_short(out)
        message, reason = self.plan.reply(self.text, cut)
        calls = message.get("tool_calls") or ([message] if "function_call" in message else [])
        streamed = [live for live in self.calls if live.named]
        if not calls and not streamed:
            self.mode = "content"
            names = {f["name"] for f in self.plan.functions}
            kept = self.plan.family.before_cut_call(self.text, names) if cut else self.text
            yield from self._content(len(kept))
        for i, call in enumerate(calls):
            fn = call["function"] if "function" in call else call["function_call"]
            live = streamed[i] if i < len(streamed) else None
            if live is None or live.scanner.name != fn["name"]:
                yield self._head(i, call.get("id") or new_call_id(), fn["name"])
                yield self._arguments(i, fn["arguments"])
            elif fn["arguments"].startswith(live.args_sent) and fn["arguments"] != live.args_sent:
                yield self._arguments(i, fn["arguments"][len(live.args_sent) :])
        yield self.chunks.chat_delta(self.index, {}, reason or finish_reason(out))

    def _content(self, end: int) -> Iterator[bytes]:
        if end > self.sent:
            delta = {"content": self.text[self.sent : end]}
            self.sent = end
            yield self._chunk(delta)

    def _head(self, index: int, call_id: str, name: str) -> bytes:
        if self.plan.legacy:
            return self._chunk({"function_call": {"name": name, "arguments": ""}})
        head = {"index": index, "id": call_id, "type": "function"}
        return self._chunk({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, index: int, piece: str) -> bytes:
        if self.plan.legacy:
            return self._chunk({"function_call": {"arguments": piece}})
        return self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def _chunk(self, delta: dict[str, Any]) -> bytes:
        return self.chunks.chat_delta(self.index, delta)


def tool_stream(plan: ToolPlan, chunks: Any) -> Callable[[int, StepOutput], Iterator[bytes]]:
    """The per-output chunk maker of a streamed reply with tools: one ToolStream per choice."""
    streams: dict[int, ToolStream] = {}

    def per_output(index: int, out: StepOutput) -> Iterator[bytes]:
        if index not in streams:
            streams[index] = ToolStream(plan, chunks, index)
        return streams[index].chat_output(out)

    return per_output
