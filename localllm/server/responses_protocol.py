"""The Responses API's request (`ResponsesRequest`) and its translation to a chat request: input items
to messages, function tools to tools, text.format to response_format."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from localllm.server.errors import APIError
from localllm.server.protocol import NOOP, NOT_YET, KeepAlive, _Request, chat_request

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Request):
    model: str | None = None
    keep_alive: KeepAlive = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {...}}: text, json_object, json_schema')
    truncation: Literal["disabled"] | None = Field(None, description="Only 'disabled' (too long is a 400).")
    stream_options: dict[str, Any] | None = Field(None, description=NOOP)
    metadata: dict[str, str] | None = Field(None, description=NOOP)
    store: bool | None = Field(None, description="Accepted; nothing is ever stored.")
    user: str | None = Field(None, description=NOOP)
    safety_identifier: str | None = Field(None, description=NOOP)
    prompt_cache_key: str | None = Field(None, description="Accepted; prefix caching is automatic.")
    prompt_cache_retention: str | None = Field(None, description=NOOP)
    service_tier: str | None = Field(None, description=NOOP)
    include: list[str] | None = Field(None, description=NOT_YET)
    previous_response_id: str | None = Field(None, description=NOT_YET)
    conversation: Any = Field(None, description=NOT_YET)
    background: bool | None = Field(None, description=NOT_YET)
    reasoning: dict[str, Any] | None = Field(
        None, description="effort is passed to the chat template as reasoning_effort; summary: no-op."
    )
    prompt: dict[str, Any] | None = Field(None, description=NOT_YET)
    max_tool_calls: int | None = Field(None, description=NOT_YET)
    top_logprobs: int | None = Field(None, description=NOT_YET)
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Accepted; caching is automatic.")
    moderation: Any = Field(None, description=NOT_YET)
    context_management: Any = Field(None, description=NOT_YET)
    background_options: Any = Field(None, description=NOT_YET)
    access_programs: Any = Field(None, description=NOT_YET)
    image: Any = Field(None, description=NOT_YET)

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "include": (None, []),
        "previous_response_id": (None,),
        "conversation": (None,),
        "background": (None, False),
        "prompt": (None,),
        "max_tool_calls": (None,),
        "top_logprobs": (None, 0),
        "moderation": (None,),
        "context_management": (None,),
        "background_options": (None,),
        "access_programs": (None,),
        "image": (None,),
    }

    def check_supported(self) -> None:
        for name, accepted in self.REFUSED.items():
            if not any(getattr(self, name) == ok for ok in accepted):
                raise APIError(f"'{name}' is not supported by this server yet", param=name)

    def effort(self) -> str | None:
        """reasoning.effort (the chat request validates its value); other keys are refused by name."""
        config = dict(self.reasoning or {})
        effort = config.pop("effort", None)
        config.pop("summary", None)  # no summaries are written: the reasoning item holds the text itself
        config.pop("generate_summary", None)
        if config:
            raise APIError(f"reasoning: unknown keys {sorted(config)}", param="reasoning")
        return effort

    def to_chat(self) -> Any:
        """The equivalent chat request (protocol.ChatCompletionRequest)."""
        self.check_supported()
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return chat_request(
            {
                "reasoning_effort": self.effort(),
                "model": self.model,
                "messages": system + input_messages(self.input),
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "tools": [chat_tool(t, i) for i, t in enumerate(self.tools)] if self.tools else None,
                "tool_choice": chat_tool_choice(self.tool_choice),
                "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": response_format(self.text),
            }
        )


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, function calls (grouped into one assistant turn) and
    their outputs (tool messages)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = reasoning_text(item, i)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"input[{i}].role must be user, assistant, system or developer", param="input")
            messages.append({"role": role, "content": text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": _call_function(item, i)}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = text_of(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise APIError(f"input[{i}]: items of type {kind!r} are not supported", param="input")
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thought = thought, None
    if not messages:
        raise APIError("'input' is empty", param="input")
    return messages


def reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning item's text (its reasoning_text parts, else its summary's), for the template."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise APIError(f"input[{i}]: a reasoning item's content must be a list of parts", param="input")
    return "\n\n".join(str(p.get("text", "")) for p in parts)


def _call_function(item: dict[str, Any], i: int) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise APIError(f"input[{i}]: a function_call needs a name and arguments (JSON text)", param="input")
    return {"name": name, "arguments": arguments}


def text_of(content: Any, where: str) -> str:
    """A text or a list of text parts (input_text / output_text) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or "text" not in part:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                f"{where}: content parts of type {kind!r} are not supported (text only)", param="input"
            )
        texts.append(str(part["text"]))
    return "\n".join(texts)


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters}) in chat's form."""
    if tool.get("type") != "function":
        raise APIError(f"tools[{i}]: only tools of type 'function' are supported", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError("tool_choice must be none, auto, required or name a function", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}
