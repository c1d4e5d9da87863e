"""POST /v1/responses: OpenAI's Responses API, as newer agents speak it, over the chat pipeline.

A request is translated to a chat request (instructions -> a system message, input items -> messages,
function tools -> tools, text.format -> response_format) and run as /v1/chat/completions runs one; the
reply comes back as output items (a `reasoning` item with a thinking model's reasoning_text, a `message`
with `output_text`, `function_call`s); `reasoning.effort` reaches the chat template as reasoning_effort,
and `reasoning` input items give the next assistant turn its `reasoning_content`. Nothing is stored:
`previous_response_id` and `conversation` are refused. Streams use the API's named events:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta ... response.completed (or response.incomplete).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from localllm.engine.output import StepOutput
from localllm.server.errors import stream_error_of
from localllm.server.jobs import CLIENT_CLOSED, ChatRun, EventStream, collect
from localllm.server.model_pool import model_state
from localllm.server.pipeline import start_chat
from localllm.server.replies import chat_choice, cut_short
from localllm.server.responses_protocol import (
    ResponsesRequest,
)
from localllm.server.streaming import live_deltas, sse_event

# --------------------------------------------------------------------------------------- the reply


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant message as output items: its reasoning, its text, then its function calls."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", "completed"))
    for call in calls:
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    item_id = item_id or f"rs_{uuid.uuid4().hex}"
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": "completed"}


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    item_id = item_id or f"msg_{uuid.uuid4().hex}"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": chat_usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
        },
        "total_tokens": chat_usage["total_tokens"],
    }


def response_body(
    rid: str, body: ResponsesRequest, model: str, created: int, output: list[dict[str, Any]]
) -> dict[str, Any]:
    """The response object, in progress (no usage yet) until `finish` completes it."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": body.effort(), "summary": None},
        "store": False,
        "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def finish(response: dict[str, Any], run: ChatRun, outs: list[StepOutput]) -> dict[str, Any]:
    """The response completed (or incomplete: cut at max_output_tokens, whatever it holds) with its
    output and usage."""
    message = reply_message(run, outs)
    truncated = bool(outs) and cut_short(outs[-1])
    return {
        **response,
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "output": output_items(message),
        "usage": responses_usage(run.usage()),
    }


def reply_message(run: ChatRun, outs: list[StepOutput]) -> dict[str, Any]:
    choice = chat_choice(0, outs, None)
    return (run.tools.apply(choice) if run.tools is not None else choice)["message"]


# ---------------------------------------------------------------------------------------- handler


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = await model_state(request, body)
    run = await start_chat(state, body.to_chat(), "resp")
    response = response_body(
        run.jobs[0].id.replace("-", "_", 1), body, state.config.model_id, int(time.time()), []
    )
    if body.stream:
        return EventStream(stream(response, run), run.jobs)
    results = await collect(run.jobs, request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(finish(response, run, results[0]))


class _Events:
    """Numbered events of one stream."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, kind: str, **data: Any) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(self.numbers), **data})


async def stream(response: dict[str, Any], run: ChatRun) -> AsyncIterator[bytes]:
    """The Responses event stream: text deltas as they come, each function call as it is written (its
    item added, then function_call_arguments.delta pieces), the done events and response.completed."""
    event, job, deltas = _Events(), run.jobs[0], live_deltas(run.tools)
    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    outs: list[StepOutput] = []
    live = _LiveItems(event)
    try:
        async for out in job.outputs():
            outs.append(out)
            for delta in deltas(out):
                for chunk in live.add(delta):
                    yield chunk
        done = finish(response, run, outs)
        if live.items:
            live.settle(sum(item["type"] == "function_call" for item in done["output"]))
            done["output"] = live.items
            chunks = live.close()
        else:  # nothing was streamed (an empty reply): its items whole
            chunks = _close_items(event, done["output"], opened=False)
        for chunk in chunks:
            yield chunk
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield event(kind, response=done)
    except Exception as e:  # after the 200 header an error can only travel inside the stream
        error = stream_error_of(e)
        yield event("error", code=error.code or error.type, message=error.message, param=None)
    finally:
        job.close()


class _LiveItems:
    """The output items of a stream as they are written, one open at a time: the message (its text),
    then a function_call item per call (tool_stream.ToolStream's deltas: a head, then argument pieces)."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []  # each as it will be once done
        self.open = False

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        chunks: list[bytes] = []
        if delta.get("reasoning_content"):
            chunks += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            if not self.open or self.items[-1]["type"] != "message":
                chunks += self.close()
                self.items.append(message_item("", "completed"))
                chunks += _open_message(self.event, self.items[-1]["id"], len(self.items) - 1)
                self.open = True
            self.items[-1]["content"][0]["text"] += delta["content"]
            chunks.append(self.event("response.output_text.delta", **self._where(), delta=delta["content"]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                chunks += self.close()
                chunks.append(self._open_call(call["id"], call["function"]["name"]))
            piece = call["function"].get("arguments")
            if piece:
                self.items[-1]["arguments"] += piece
                chunks.append(
                    self.event("response.function_call_arguments.delta", **self._where(), delta=piece)
                )
        return chunks

    def _reasoning(self, piece: str) -> list[bytes]:
        """A piece of the thinking: in the open reasoning item, or one opened for it."""
        chunks: list[bytes] = []
        if not self.open or self.items[-1]["type"] != "reasoning":
            chunks += self.close()
            self.items.append(reasoning_item(""))
            added = {**self.items[-1], "content": [], "status": "in_progress"}
            index = len(self.items) - 1
            chunks.append(self.event("response.output_item.added", output_index=index, item=added))
            self.open = True
        self.items[-1]["content"][0]["text"] += piece
        chunks.append(self.event("response.reasoning_text.delta", **self._where(), delta=piece))
        return chunks

    def _open_call(self, call_id: str, name: str) -> bytes:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name}
        self.items.append({**item, "arguments": "", "status": "completed"})
        self.open = True
        added = {**item, "arguments": "", "status": "in_progress"}
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)

    def settle(self, complete_calls: int) -> None:
        """Mark the function calls streamed past the reply's `complete_calls` (one a length limit cut
        while it was written) incomplete: their arguments stop where the reply did."""
        calls = [item for item in self.items if item["type"] == "function_call"]
        for item in calls[complete_calls:]:
            item["status"] = "incomplete"

    def close(self) -> list[bytes]:
        """The open item's done events."""
        if not self.open:
            return []
        self.open = False
        item, where = self.items[-1], self._where()
        if item["type"] == "message":
            part = item["content"][0]
            chunks = [self.event("response.output_text.done", **where, text=part["text"])]
            chunks.append(self.event("response.content_part.done", **where, part=part))
        elif item["type"] == "reasoning":
            chunks = [self.event("response.reasoning_text.done", **where, text=item["content"][0]["text"])]
        else:
            args = item["arguments"]
            chunks = [self.event("response.function_call_arguments.done", **where, arguments=args)]
        done = self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        return [*chunks, done]

    def _where(self) -> dict[str, Any]:
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        return {**where, "content_index": 0} if self.items[-1]["type"] != "function_call" else where


def _open_message(event: _Events, msg_id: str, index: int = 0) -> list[bytes]:
    item = message_item("", "in_progress", msg_id)
    where = {"item_id": msg_id, "output_index": index, "content_index": 0}
    return [
        event("response.output_item.added", output_index=index, item=item),
        event("response.content_part.added", **where, part=output_text("")),
    ]


def _close_items(event: _Events, items: list[dict[str, Any]], opened: bool) -> list[bytes]:
    """Each output item's closing events (and, unless it was streamed live, its opening ones)."""
    chunks = []
    for index, item in enumerate(items):
        opened = opened and index == 0  # only the first message can have been streamed live
        if item["type"] == "message":
            part, where = (
                item["content"][0],
                {"item_id": item["id"], "output_index": index, "content_index": 0},
            )
            if not opened:
                chunks += _open_message(event, item["id"])
                if part["text"]:
                    chunks.append(event("response.output_text.delta", **where, delta=part["text"]))
            chunks.append(event("response.output_text.done", **where, text=part["text"]))
            chunks.append(event("response.content_part.done", **where, part=part))
        elif item["type"] == "reasoning":
            chunks += _whole_reasoning(event, item, index)
        else:
            chunks.append(
                event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            )
            where = {"item_id": item["id"], "output_index": index}
            chunks.append(event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
            chunks.append(
                event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
        chunks.append(event("response.output_item.done", output_index=index, item=item))
    return chunks


def _whole_reasoning(event: _Events, item: dict[str, Any], index: int) -> list[bytes]:
    """A reasoning item not streamed live, sent whole."""
    text = item["content"][0]["text"]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    added = {**item, "content": [], "status": "in_progress"}
    return [
        event("response.output_item.added", output_index=index, item=added),
        event("response.reasoning_text.delta", **where, delta=text),
        event("response.reasoning_text.done", **where, text=text),
    ]
