"""Tool calling on the chat endpoint: validate `tools` / `tool_choice` (or legacy `functions` /
`function_call`), render them through the model's chat template, constrain `required` and named
choices with the family's call grammar, and turn the reply back into `tool_calls` (streamed: tool_stream.py).

tool_choice "none" leaves the tools out of the prompt (the model cannot call what it is not shown), as
llama-server does. Templates that render no `tools` get them in a system message, Hermes-style.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from localllm.server.errors import APIError
from localllm.server.protocol import ChatCompletionRequest
from localllm.structured.spec import StructuredSpec
from localllm.structured.tools import (
    Tool,
    ToolFamily,
    bare_call,
    fallback_system_prompt,
    template_knows_tools,
    tool_family,
)

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass
class ToolPlan:
    functions: list[dict[str, Any]]  # {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required" or "named"
    named: str | None
    parallel: bool
    legacy: bool  # functions/function_call: answered with message.function_call
    family: ToolFamily
    native: bool  # the template renders `tools` itself

    def spec(self, tokenizer: Any) -> StructuredSpec | None:
        """The grammar that forces a call (required / named); None for auto."""
        if self.choice == "auto":
            return None
        chosen = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        tools = [Tool(f["name"], f.get("parameters") or {}) for f in chosen]
        parallel = self.parallel and self.choice == "required"
        return self.family.grammar(tools, parallel, lambda marker: marker_terminal(tokenizer, marker))

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def apply(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chat.completion choice with its message's calls parsed out ("length" stays: see reply)."""
        cut = choice.get("finish_reason") == "length"
        message, reason = self.reply(choice["message"]["content"], cut)
        if "reasoning_content" in choice["message"]:  # the thinking before the calls
            message["reasoning_content"] = choice["message"]["reasoning_content"]
        if reason is None:
            return {**choice, "message": message}
        rest = {k: v for k, v in choice.items() if k != "native_finish_reason"}
        return {**rest, "message": message, "finish_reason": reason}

    def reply(self, text: str, cut: bool = False) -> tuple[dict[str, Any], str | None]:
        """The assistant message for `text`, and the finish_reason that replaces the engine's when the
        reply holds calls. A reply `cut` by a length limit keeps its reason ("length": an agent must not
        take it as done) and loses the call it was writing, neither text nor a call with cut arguments."""
        names = {f["name"] for f in self.functions}
        if cut:
            text = self.family.before_cut_call(text, names)
        message, reason = self._message(text, names)
        return message, None if cut else reason

    def _message(self, text: str, names: set[str]) -> tuple[dict[str, Any], str | None]:
        content, calls = self.family.parse(text)
        if not calls:
            call = bare_call(text, names)
            if call is None:
                return {"role": "assistant", "content": text}, None
            content, calls = "", [call]
        calls = calls if self.parallel else calls[:1]
        if self.legacy:
            call = calls[0].as_openai()["function"]
            return {"role": "assistant", "content": content or None, "function_call": call}, "function_call"
        message = {"role": "assistant", "content": content or None}
        message["tool_calls"] = [c.as_openai() for c in calls]
        return message, "tool_calls"


def marker_terminal(tokenizer: Any, marker: str) -> str:
    """The start marker as a Lark terminal: a control token by its id (its text can never match)."""
    tid = tokenizer.special_tokens.get(marker)
    if tid is not None and tokenizer.is_control(tid):
        return f"<[{tid}]>"
    return json.dumps(marker)


# ------------------------------------------------------------------------------------ the request


def tool_plan(body: ChatCompletionRequest, template_source: str) -> ToolPlan | None:
    """What the request asks of tools; None when it offers none or tool_choice is "none"."""
    if (body.tools, body.tool_choice) != (None, None) and (body.functions, body.function_call) != (
        None,
        None,
    ):
        raise APIError("give tools or the legacy functions, not both", param="functions")
    legacy = body.functions is not None or body.function_call is not None
    param = "functions" if legacy else "tools"
    raw = body.functions if legacy else [_tool_function(t, i) for i, t in enumerate(body.tools or [])]
    functions = [_function(f, param, i) for i, f in enumerate(raw or [])]
    choice_param = "function_call" if legacy else "tool_choice"
    choice_value = body.function_call if legacy else body.tool_choice
    if not functions:
        if choice_value not in (None, "none", "auto"):
            raise APIError(f"{choice_param} is only allowed when {param} are specified", param=choice_param)
        return None
    choice, named = _choice(choice_value, {f["name"] for f in functions}, choice_param, legacy)
    if choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False and not legacy
    family = tool_family(template_source)
    return ToolPlan(functions, choice, named, parallel, legacy, family, template_knows_tools(template_source))


def _tool_function(tool: Any, index: int) -> Any:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise APIError(f"tools[{index}]: only tools of type 'function' are supported", param="tools")
    return tool.get("function")


def _function(f: Any, param: str, index: int) -> dict[str, Any]:
    where = f"{param}[{index}]"
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
        raise APIError(f"{where}: a function needs a name of 1-64 letters, digits, _ or -", param=param)
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError(f"{where}.parameters must be a JSON schema object", param=param)
    out = {"name": f["name"], "description": f.get("description"), "parameters": params}
    return {k: v for k, v in out.items() if v is not None}


def _choice(value: Any, names: set[str], param: str, legacy: bool) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto") or (value == "required" and not legacy):
        return value, None
    name = None
    if isinstance(value, dict):
        named = value if legacy else value.get("function")
        name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise APIError(f"{param} must be 'none', 'auto', 'required' or name a function", param=param)
    if name not in names:
        raise APIError(f"{param} names '{name}', which is not among the functions given", param=param)
    return "named", name


# ------------------------------------------------------------------------------ the conversation


def prepare_messages(
    dicts: list[dict[str, Any]], template_source: str, plan: ToolPlan | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages as the template expects them, and the template's extra variables (`tools`)."""
    dicts = [_with_call_objects(d) for d in dicts]
    if template_knows_tools(template_source):
        return dicts, ({"tools": plan.openai_tools()} if plan is not None else {})
    dicts = [_as_text(d) for d in dicts]
    if plan is not None:
        prompt = fallback_system_prompt(plan.openai_tools())
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{prompt}"}
        else:
            dicts.insert(0, {"role": "system", "content": prompt})
    return dicts, {}


def _with_call_objects(d: dict[str, Any]) -> dict[str, Any]:
    """Assistant calls with their arguments as objects (templates `tojson` them), legacy function_call
    read as a tool call, and legacy `function` results as `tool` messages."""
    d = dict(d)
    if d["role"] == "function":
        d["role"] = "tool"
    if d["role"] == "assistant" and isinstance(d.get("function_call"), dict):
        d["tool_calls"] = [{"type": "function", "function": d.pop("function_call")}]
    if d["role"] == "assistant" and d.get("tool_calls"):
        if not isinstance(d["tool_calls"], list):
            raise APIError("an assistant message's 'tool_calls' must be a list", param="messages")
        d["tool_calls"] = [_call_object(c) for c in d["tool_calls"]]
    return d


def _call_object(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError("each tool call needs a 'function' object", param="messages")
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"] or "{}")
        except json.JSONDecodeError:
            raise APIError("tool call arguments must be JSON text", param="messages") from None
    return {**call, "function": fn}


def _as_text(d: dict[str, Any]) -> dict[str, Any]:
    """For a template without tools: calls and results written as Hermes text in plain turns."""
    if d["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{d.get('content', '')}\n</tool_response>"}
    if d["role"] == "assistant" and d.get("tool_calls"):
        calls = [
            json.dumps({"name": c["function"].get("name"), "arguments": c["function"].get("arguments")})
            for c in d["tool_calls"]
        ]
        text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        content = d.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{text}".strip()}
    return d
