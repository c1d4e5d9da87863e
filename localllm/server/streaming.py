"""Server-Sent Events exactly as OpenAI frames them.

Chat: a role chunk, content deltas, a final chunk with an empty delta and `finish_reason`, the usage
chunk (`choices: []`) when `stream_options.include_usage` is set, then `data: [DONE]`. Completions:
text chunks, a final chunk with `finish_reason`, the usage chunk, `[DONE]`. The engine already emits
whole UTF-8 characters and holds back stop strings, so deltas are forwarded as they come.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from localllm.engine.output import StepOutput
from localllm.server.protocol import (
    chat_logprobs,
    completion_logprobs,
    error_body,
    finish_reason,
    is_stop_token,
    usage,
)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of events


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
    text_offset: int = 0  # completions: character offset of the next token, for text_offset

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        chunk = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model}
        chunk["choices"] = choices
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def usage_tail(self, last: StepOutput | None) -> list[bytes]:
        """The usage chunk (`choices: []`), when the client asked for it with stream_options."""
        if not self.include_usage:
            return []
        chunk = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model}
        return [sse({**chunk, "choices": [], "usage": usage(last)})]

    # -- chat ---------------------------------------------------------------------------------------

    def chat_role(self) -> bytes:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def chat_output(self, out: StepOutput) -> Iterator[bytes]:
        """A content delta when there is text (or a logprob to report), then the finish chunk if done."""
        lp = out.logprob if (self.logprobs and out.logprob is not None and not is_stop_token(out)) else None
        if out.text or lp is not None:
            logprobs = chat_logprobs(self.tokenizer, [lp]) if lp is not None else None
            choice = {"index": 0, "delta": {"content": out.text}, "logprobs": logprobs, "finish_reason": None}
            yield self._chunk([choice])
        if out.finished:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(out)}
            yield self._chunk([choice])

    # -- completions --------------------------------------------------------------------------------

    def completion_text(self, text: str) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return self._chunk([choice])

    def completion_output(self, out: StepOutput) -> Iterator[bytes]:
        lp = out.logprob if (self.logprobs and out.logprob is not None and not is_stop_token(out)) else None
        if out.text or lp is not None:
            logprobs = None
            if lp is not None:
                logprobs = completion_logprobs(self.tokenizer, [lp], self.text_offset)
            self.text_offset += len(out.text)
            choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": None}
            yield self._chunk([choice])
        if out.finished:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(out)}
            yield self._chunk([choice])
