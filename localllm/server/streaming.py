"""Server-Sent Events exactly as OpenAI frames them.

Chat: a role chunk, content deltas, a final chunk with an empty delta and `finish_reason`, the usage
chunk (`choices: []`) when `stream_options.include_usage` is set, then `data: [DONE]`. Completions:
text chunks, a final chunk with `finish_reason`, the usage chunk, `[DONE]`. The engine already emits
whole UTF-8 characters and holds back stop strings, so deltas are forwarded as they come.
`live_deltas` gives the Responses and Anthropic Messages streams the same deltas to frame their way.
A thinking model's reasoning goes in `reasoning_content` deltas, before the content of the same output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localllm.engine.output import StepOutput
from localllm.server.errors import error_body
from localllm.server.replies import (
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    finish_fields,
    finish_reason,
    is_stop_token,
)
from localllm.server.tool_stream import ToolStream

if TYPE_CHECKING:
    from localllm.server.tool_calls import ToolPlan

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of events


# Characters that str.splitlines (and so httpx's iter_lines and many clients) takes for line breaks, which
# json.dumps leaves raw with ensure_ascii=False: escaped, so a token holding one cannot cut an event.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_json(payload: dict[str, Any]) -> str:
    """One event's data: compact JSON, non-ASCII text kept as it is but for line-breaking characters."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + event_json(payload).encode() + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """A named event (`event:` line), as the Responses and Anthropic Messages streams frame theirs."""
    return f"event: {event}\ndata: {event_json(payload)}\n\n".encode()


def sse_error(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An error after the 200 header went out can only be reported inside the stream (as vLLM does)."""
    return sse(error_body(message, type, None, code))


@dataclass
class ChunkBuilder:
    """Builds the chunks of one streamed response; `usage: null` on each when usage was asked for."""

    request_id: str
    model: str
    tokenizer: Any
    object: str  # "chat.completion.chunk" | "text_completion"
    include_usage: bool = False
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str | None = None  # system_fingerprint, on every chunk as OpenAI sends it
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions: next token's offset per choice

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        chunk = self._head()
        chunk["choices"] = choices
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def usage_tail(self, totals: dict[str, Any]) -> list[bytes]:
        """The usage chunk (`choices: []`), when the client asked for it with stream_options."""
        if not self.include_usage:
            return []
        return [sse({**self._head(), "choices": [], "usage": totals})]

    def _head(self) -> dict[str, Any]:
        head = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model}
        head["system_fingerprint"] = self.fingerprint
        return head

    # -- chat ---------------------------------------------------------------------------------------

    def chat_role(self, index: int = 0) -> bytes:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def chat_delta(self, index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        """A chunk of choice `index` carrying `delta` (tool calls: server/tool_calls.py)."""
        return self._chunk([{"index": index, "delta": delta, "logprobs": None, **finish_fields(finish)}])

    def chat_output(self, index: int, out: StepOutput) -> Iterator[bytes]:
        """A reasoning delta when the model thinks, a content delta when there is text (or a logprob
        to report), then the finish chunk if done."""
        if out.reasoning:
            yield self.chat_delta(index, {"reasoning_content": out.reasoning})
        lp = out.logprob if (self.logprobs and out.logprob is not None and not is_stop_token(out)) else None
        if out.text or lp is not None:
            logprobs = chat_logprobs(self.tokenizer, [lp]) if lp is not None else None
            choice = {
                "index": index,
                "delta": {"content": out.text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
            yield self._chunk([choice])
        if out.finished:
            yield self.chat_delta(index, {}, finish_reason(out))

    # -- completions --------------------------------------------------------------------------------

    def completion_text(
        self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None, finish: str | None = None
    ) -> bytes:
        """A text chunk of choice `index` (the echoed prompt, with its logprobs when asked for)."""
        self.text_offsets[index] = self.text_offsets.get(index, 0) + len(text)
        return self._chunk([completion_choice(index, text, logprobs, finish)])

    def completion_output(self, index: int, out: StepOutput) -> Iterator[bytes]:
        lp = out.logprob if (self.logprobs and out.logprob is not None and not is_stop_token(out)) else None
        if out.text or lp is not None:
            logprobs = None
            if lp is not None:
                logprobs = completion_logprobs(self.tokenizer, [lp], self.text_offsets.get(index, 0))
            yield self.completion_text(out.text, index, logprobs)
        if out.finished:
            yield self._chunk([completion_choice(index, "", None, finish_reason(out))])


class _Deltas:
    """Stands in for ChunkBuilder: tool_stream.ToolStream's deltas come back as they are."""

    @staticmethod
    def chat_delta(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return delta


def live_deltas(tools: ToolPlan | None) -> Callable[[StepOutput], list[dict[str, Any]]]:
    """Each output as the chat deltas that can be sent as it comes: its text without tools; with tools,
    tool_stream.ToolStream's (the content before a call, then each call's head and argument pieces)."""
    if tools is None:
        return lambda out: reasoning_delta(out) + ([{"content": out.text}] if out.text else [])
    tool_stream = ToolStream(tools, _Deltas())
    return lambda out: list(tool_stream.chat_output(out))


def reasoning_delta(out: StepOutput) -> list[dict[str, Any]]:
    """The output's thinking as a chat delta (none when it has none)."""
    return [{"reasoning_content": out.reasoning}] if out.reasoning else []
