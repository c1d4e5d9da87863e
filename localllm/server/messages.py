"""POST /v1/messages: Anthropic's Messages API, as Claude-style agents speak it, over the chat pipeline.

A request is translated to a chat request (system -> a system message, content blocks -> messages,
tool_use / tool_result blocks -> tool calls and tool messages, tools' input_schema -> parameters,
tool_choice auto/any/tool/none) and run as /v1/chat/completions runs one; the reply comes back as
content blocks with Anthropic's stop_reason. Errors on this path have Anthropic's shape
({"type": "error", "error": {"type", "message"}}: errors.py); `x-api-key` is accepted as the key
(guards.py). A thinking model's reasoning comes back as a `thinking` block (unsigned); `thinking` blocks
of earlier turns go to the template as the turn's `reasoning_content`, `redacted_thinking` ones are
dropped.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from localllm.engine.output import StepOutput
from localllm.server.errors import APIError, error_of
from localllm.server.jobs import CLIENT_CLOSED, ChatRun, EventStream, collect
from localllm.server.model_pool import model_state
from localllm.server.pipeline import chat_prompt_length, start_chat
from localllm.server.protocol import NOOP, NOT_YET, KeepAlive, _Request, chat_request
from localllm.server.replies import chat_choice, cut_short
from localllm.server.streaming import live_deltas, sse_event


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Request):
    model: str | None = None
    keep_alive: KeepAlive = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(
        None, description="format (a JSON schema) is enforced; effort is refused."
    )
    metadata: dict[str, Any] | None = Field(None, description=NOOP)
    service_tier: str | None = Field(None, description=NOOP)
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; prefix caching is automatic.")
    diagnostics: dict[str, Any] | None = Field(None, description=NOOP)
    inference_geo: str | None = Field(None, description=NOOP)
    speed: str | None = Field(None, description=NOOP)
    user_profile_id: str | None = Field(None, description=NOOP)
    workspace_id: str | None = Field(None, description=NOOP)
    thinking: dict[str, Any] | None = Field(
        None, description="enabled (budget_tokens: the reasoning budget), adaptive, or disabled."
    )
    container: Any = Field(None, description=NOT_YET)
    mcp_servers: Any = Field(None, description=NOT_YET)

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "container": (None,),
        "mcp_servers": (None, []),
    }

    def thinking_fields(self) -> dict[str, Any]:
        """`thinking` as chat fields: disabled switches the template's thinking off (Qwen3's
        enable_thinking) and closes any block at once; enabled's budget_tokens is the reasoning budget."""
        config = self.thinking or {}
        kind = config.get("type", "enabled") if self.thinking is not None else None
        if kind not in (None, "enabled", "adaptive", "disabled"):
            raise APIError("thinking.type must be enabled, adaptive or disabled", param="thinking")
        if kind == "disabled":
            return {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_budget": 0}
        budget = config.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise APIError("thinking.budget_tokens must be a whole number >= 0", param="thinking")
        return {"reasoning_budget": budget}

    def response_format(self) -> dict[str, Any] | None:
        """output_config.format (a JSON schema) as chat's response_format."""
        config = dict(self.output_config or {})
        if config.pop("effort", None) is not None:
            raise APIError("'output_config.effort' is not supported by this server", param="output_config")
        fmt = config.pop("format", None)
        if config:
            raise APIError(f"output_config: unknown keys {sorted(config)}", param="output_config")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise APIError("output_config.format must be a json_schema with a schema", param="output_config")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

    def to_chat(self) -> Any:
        """The equivalent chat request (protocol.ChatCompletionRequest)."""
        for name, accepted in self.REFUSED.items():
            if not any(getattr(self, name) == ok for ok in accepted):
                raise APIError(f"'{name}' is not supported by this server yet", param=name)
        system = system_text(self.system)
        messages = [{"role": "system", "content": system}] if system else []
        for i, m in enumerate(self.messages):
            messages += chat_messages(m, i)
        choice, parallel = chat_tool_choice(self.tool_choice)
        # A final assistant turn is a prefill: the reply continues it (Anthropic's meaning)
        prefill = messages[-1]["role"] == "assistant" and bool(messages[-1].get("content"))
        return chat_request(
            {
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_tokens,
                "stop": self.stop_sequences,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "tools": [chat_tool(t, i) for i, t in enumerate(self.tools)] if self.tools else None,
                "tool_choice": choice,
                "parallel_tool_calls": parallel,
                "response_format": self.response_format(),
                "continue_final_message": prefill or None,
                **self.thinking_fields(),
            }
        )


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what a request would put in the prompt."""

    model: str | None = None
    keep_alive: KeepAlive = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="As in /v1/messages.")
    mcp_servers: Any = Field(None, description=NOT_YET)

    def to_chat(self) -> Any:
        return MessagesRequest(**self.model_dump(exclude_none=True), max_tokens=1).to_chat()


# ------------------------------------------------------------------------------------ translation


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return blocks_text(system, "system")


def blocks_text(blocks: list[dict[str, Any]], where: str) -> str:
    if not isinstance(blocks, list):
        raise APIError(f"{where}: content must be a string or a list of blocks", param=where)
    texts = []
    for block in blocks:
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(f"{where}: blocks of type {kind!r} are not supported here", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def chat_messages(message: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results first (as tool messages), then the text, with
    an assistant's tool_use blocks as its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    where = f"messages[{i}]"
    out: list[dict[str, Any]] = []
    texts, calls, thoughts = [], [], []
    for block in message.content:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and message.role == "assistant" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])  # given to the template, which decides to show it or not
        elif kind == "redacted_thinking" and message.role == "assistant":
            continue  # another model's encrypted thinking: nothing a local model can read
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            text = content if isinstance(content, str) else blocks_text(content, "messages")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        else:
            raise APIError(
                f"{where}: {message.role} blocks of type {kind!r} are not supported", param="messages"
            )
    if texts or calls or thoughts or not out:
        turn: dict[str, Any] = {
            "role": message.role,
            "content": "\n".join(texts) if texts or not calls else None,
        }
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            turn["reasoning_content"] = "\n\n".join(thoughts)
        out.append(turn)
    return out


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise APIError(f"{where}: a tool_use block needs a name and an input object", param="messages")
    fn = {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}
    return {"id": block.get("id"), "type": "function", "function": fn}


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A client tool ({name, description, input_schema}) in chat's form; server tools are refused."""
    if tool.get("type", "custom") != "custom":
        raise APIError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported", param="tools")
    fn = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("input_schema"),
    }
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """tool_choice (auto, any, tool, none) as chat's, and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError("tool_choice.type must be auto, any, tool (with a name) or none", param="tool_choice")


# --------------------------------------------------------------------------------------- the reply


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):  # no signature: nothing here is signed
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])}
        )
    return blocks


def stop_of(outs: list[StepOutput], message: dict[str, Any]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: a reply cut short (max_tokens, or the loop guard) says
    max_tokens even when it holds calls, as a cut one may have been followed by more."""
    last = outs[-1] if outs else None
    if last is not None and cut_short(last):
        return "max_tokens", None
    if message.get("tool_calls"):
        return "tool_use", None
    if last is not None and isinstance(last.stop_reason, str):
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def messages_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,  # Anthropic counts cache reads apart
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": chat_usage["completion_tokens"],
    }


def message_body(rid: str, model: str, run: ChatRun, outs: list[StepOutput]) -> dict[str, Any]:
    choice = chat_choice(0, outs, None)
    message = (run.tools.apply(choice) if run.tools is not None else choice)["message"]
    stop_reason, stop_sequence = stop_of(outs, message)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(message),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": messages_usage(run.usage()),
    }


# ---------------------------------------------------------------------------------------- handler


async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = await model_state(request, body)
    run = await start_chat(state, body.to_chat(), "msg")
    rid, model = run.jobs[0].id.replace("-", "_", 1), state.config.model_id
    if body.stream:
        return EventStream(stream(rid, model, run), run.jobs)
    results = await collect(run.jobs, request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(message_body(rid, model, run, results[0]))


async def count_message_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    return {"input_tokens": await chat_prompt_length(await model_state(request, body), body.to_chat())}


def event(kind: str, **data: Any) -> bytes:
    return sse_event(kind, {"type": kind, **data})


async def stream(rid: str, model: str, run: ChatRun) -> AsyncIterator[bytes]:
    """message_start, the text block's deltas as they come, each tool_use block as its call is written
    (content_block_start with its id and name, then input_json_delta pieces of its input), then
    message_delta with the stop reason and usage, message_stop."""
    job, deltas = run.jobs[0], live_deltas(run.tools)
    head = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": []}
    usage = {**messages_usage(run.usage()), "output_tokens": 0}
    yield event("message_start", message={**head, "stop_reason": None, "stop_sequence": None, "usage": usage})
    outs: list[StepOutput] = []
    blocks = _LiveBlocks()
    try:
        async for out in job.outputs():
            outs.append(out)
            for delta in deltas(out):
                for chunk in blocks.add(delta):
                    yield chunk
        body = message_body(rid, model, run, outs)
        for chunk in blocks.close() if blocks.kind is not None else _whole(body["content"]):
            yield chunk
        delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
        yield event("message_delta", delta=delta, usage=body["usage"])
        yield event("message_stop")
    except Exception as e:  # after the 200 header an error can only travel inside the stream
        yield event("error", error={"type": "api_error", "message": error_of(e).message})
    finally:
        job.close()


def _whole(blocks: list[dict[str, Any]]) -> list[bytes]:
    """Blocks none of which was streamed live (an empty reply's text block), each sent whole."""
    chunks = []
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        chunks.append(event("content_block_start", index=index, content_block=start))
        chunks.append(event("content_block_delta", index=index, delta=delta))
        chunks.append(event("content_block_stop", index=index))
    return chunks


class _LiveBlocks:
    """The content blocks of a stream, one open at a time: a thinking block, a text block, or a tool_use
    block per call (tool_stream.ToolStream's deltas: a call's head, then pieces of its arguments text)."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self.kind: str | None = None  # "thinking" | "text" | "tool_use" | None (none open)

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        chunks: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                chunks += self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            chunks.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                chunks += self._start({"type": "text", "text": ""}, "text")
            chunks.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "id" in call:
                use = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
                chunks += self._start(use, "tool_use")
            if fn.get("arguments"):
                chunks.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return chunks

    def close(self) -> list[bytes]:
        return [event("content_block_stop", index=self.index)] if self.kind is not None else []

    def _start(self, block: dict[str, Any], kind: str) -> list[bytes]:
        chunks = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*chunks, event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", index=self.index, delta=delta)
