"""A request's constraint: `response_format` (chat) or one of the guided_* / grammar extensions (chat
and completions), turned into a StructuredSpec and compiled before the request reaches the engine, so
a bad schema or grammar is a 400 naming its field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from localllm.errors import LocalLLMError
from localllm.sampling_params import SamplingParams
from localllm.server.protocol import APIError, SamplingRequest
from localllm.structured.limits import MAX_CHOICES
from localllm.structured.spec import StructuredSpec


def _response_format_spec(response_format: dict[str, Any] | None) -> StructuredSpec | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return StructuredSpec("json_object", name="response_format")
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema") if response_format else None
    if not isinstance(spec, dict):
        raise APIError("response_format.json_schema must be an object", param="response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
        return StructuredSpec("json_object", name="response_format")
    return _spec(lambda: StructuredSpec.json_schema(schema, "response_format"), "response_format")


def _spec(make: Any, param: str) -> StructuredSpec:
    try:
        return make()
    except LocalLLMError as e:
        raise APIError(str(e), param=param) from None


def _extension_specs(body: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    makers = {
        "guided_json": lambda v: StructuredSpec.json_schema(v, "guided_json"),
        "guided_regex": lambda v: StructuredSpec("regex", v, "guided_regex"),
        "guided_grammar": lambda v: StructuredSpec("grammar", v, "guided_grammar"),
        "grammar": lambda v: StructuredSpec("grammar", v, "grammar"),
        "guided_choice": _choice_spec,
    }
    specs = []
    for name, make in makers.items():
        value = getattr(body, name)
        if value is not None:
            specs.append((name, _spec(lambda make=make, value=value: make(value), name)))
    return specs


def _choice_spec(choices: list[str]) -> StructuredSpec:
    if not choices:
        raise APIError("guided_choice must list at least one string", param="guided_choice")
    if len(choices) > MAX_CHOICES:  # past it llguidance cannot enforce the choice
        raise APIError(
            f"guided_choice lists {len(choices):,} strings; the limit is {MAX_CHOICES:,}",
            param="guided_choice",
        )
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)
    return StructuredSpec("lark", lark, "guided_choice")


def request_spec(body: SamplingRequest) -> StructuredSpec | None:
    """The one constraint a request asks for (None: free text); two at once is a 400."""
    specs = _extension_specs(body)
    response_format = getattr(body, "response_format", None)
    from_format = _response_format_spec(response_format)
    if from_format is not None:
        specs.insert(0, ("response_format", from_format))
    if len(specs) > 1:
        names = " and ".join(name for name, _ in specs[:2])
        raise APIError(f"{names} cannot be used together: give one constraint", param=specs[1][0])
    return specs[0][1] if specs else None


def compile_spec(llm: Any, spec: StructuredSpec) -> None:
    """Compile (and cache) now, on a request thread: a grammar llguidance rejects is the client's 400."""
    try:
        llm.grammars.compile(spec)
    except LocalLLMError as e:
        raise APIError(str(e), param=spec.name) from None


def constrained_params(
    llm: Any, body: SamplingRequest, params: SamplingParams, tools: Any = None
) -> SamplingParams:
    """`params` with the request's constraint compiled and attached: its own, or the call grammar of a
    required / named tool choice (`tools`: a tool_calls.ToolPlan); a reply with tools keeps special
    tokens in its text, as some families mark calls with one."""
    spec = request_spec(body)
    forced = tools.spec(llm.tokenizer) if tools is not None else None
    if forced is not None and spec is not None:
        raise APIError(f"{spec.name} cannot be combined with a required tool call", param=spec.name)
    spec = spec or forced
    if spec is not None:
        compile_spec(llm, spec)
        params = dataclasses.replace(params, structured=spec)
    if tools is not None:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
