"""Forced tool calls on a harmony (gpt-oss) model: tool_choice required or a named function is
constrained in harmony's own call syntax (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`, structured/tools.harmony_grammar), which the harmony parser reads back into
`tool_calls` with arguments valid for the tool, streamed as unstreamed. On the tiny llama with
harmony's markers (tiny_think.py): its own random choices under the grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel
from server_harness import Running, engine_factory, post, running_server, sse_payloads
from tiny_think import write_harmony_model

HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {  # a $ref into its own $defs: each call's arguments are their own JSON document
    "$defs": {"Zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "type": "object",
    "properties": {
        "zone": {"$ref": "#/$defs/Zone"},
        "hours": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["zone", "hours"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HEAD = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
MARKUP = ("<|", "<tool_call", "</tool_call", "commentary", "functions.")


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> Iterator[Running]:
    path = write_harmony_model(tmp_path_factory.mktemp("harmony") / "harmony.gguf")
    with running_server(engine_factory(path, index_dir, ctx_size=1024), model_id="oss") as running:
        yield running


def chat(srv: Running, **body: Any) -> dict[str, Any]:
    r = post(srv, "/v1/chat/completions", {"messages": HELLO, "tools": TOOLS, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(srv: Running, **body: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    """(calls assembled from the deltas, content, the last chunk's finish_reason)."""
    body = {"messages": HELLO, "tools": TOOLS, "temperature": 0, "stream": True, **body}
    chunks = [c for c in sse_payloads(post(srv, "/v1/chat/completions", body).text) if c["choices"]]
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            call["name"] += piece.get("function", {}).get("name") or ""
            call["arguments"] += piece.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)], content, chunks[-1]["choices"][0]["finish_reason"]


def check_args(name: str, arguments: Any) -> None:
    """Arguments (JSON text or parsed) valid for the tool's schema, as the grammar must make them."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Rome") and args["unit"] in "CF"
    else:
        assert set(args) == {"zone", "hours"} and args["zone"] in ("UTC", "CET")
        assert isinstance(args["hours"], int)


def written(choice: dict[str, Any]) -> str:
    """What the model wrote, markers included (logprobs give each token's text)."""
    return "".join(t["token"] for t in choice["logprobs"]["content"])


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_required_call_is_written_in_harmony_and_parsed(oss: Running, seed: int | None) -> None:
    body = {"tool_choice": "required", "logprobs": True}
    if seed is not None:
        body |= {"temperature": 1.0, "seed": seed}
    choice = chat(oss, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    check_args(name, arguments)
    assert written(choice) == HEAD.format(name) + arguments  # <|call|> ended it: not in the text
    calls, content, reason = streamed(oss, **{k: v for k, v in body.items() if k != "logprobs"})
    assert (calls, content, reason) == ([{"name": name, "arguments": arguments}], "", "tool_calls")


def test_named_choice_calls_that_function(oss: Running) -> None:
    for name in SCHEMAS:
        choice = chat(oss, tool_choice={"type": "function", "function": {"name": name}})["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert (choice["finish_reason"], call["function"]["name"]) == ("tool_calls", name), choice
        check_args(name, call["function"]["arguments"])
        calls, _, reason = streamed(oss, tool_choice={"type": "function", "function": {"name": name}})
        assert calls == [{"name": name, "arguments": call["function"]["arguments"]}]
        assert reason == "tool_calls"


def test_thinking_is_not_part_of_a_forced_call(oss: Running) -> None:
    """The call is the whole reply: no analysis message, so no reasoning_content, and the reasoning
    budget (which forces harmony's end of thinking) never breaks the grammar."""
    choice = chat(oss, tool_choice="required", reasoning_budget=0)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert not choice["message"].get("reasoning_content")


def test_cut_call_says_length_and_leaks_no_markup(oss: Running) -> None:
    whole = chat(oss, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tokens = whole["usage"]["completion_tokens"]
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    for max_tokens in (3, 12, tokens - 6, tokens - 1):
        choice = chat(oss, max_tokens=max_tokens, **named)["choices"][0]
        assert choice["finish_reason"] == "length", (max_tokens, choice)
        content = choice["message"]["content"] or ""
        assert not any(m in content for m in MARKUP), (max_tokens, content)
        kept = choice["message"].get("tool_calls") or []  # whole: closed in time by the budget steering
        for call in kept:
            check_args("get_weather", call["function"]["arguments"])
        calls, content, reason = streamed(oss, max_tokens=max_tokens, **named)
        assert reason == "length" and not any(m in content for m in MARKUP)
        if kept:
            assert calls == [{"name": "get_weather", "arguments": kept[0]["function"]["arguments"]}]
        for call in calls if not kept else []:  # the deltas stopped where the cut came: never closed
            with pytest.raises(json.JSONDecodeError):
                json.loads(call["arguments"])
    assert chat(oss, max_tokens=tokens, **named)["choices"][0]["finish_reason"] == "tool_calls"


class Weather(BaseModel):
    city: str
    unit: str


def test_openai_parse_reads_the_call_or_raises(oss: Running) -> None:
    client = oss.client()
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    tool["function"]["parameters"] = WEATHER  # the enums keep the tiny model's call short
    kw = {"model": "oss", "messages": HELLO, "tools": [tool], "tool_choice": "required", "temperature": 0}
    reply = client.chat.completions.parse(**kw)
    [call] = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)
    assert call.function.parsed_arguments.model_dump() == json.loads(call.function.arguments)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(**kw, max_tokens=reply.usage.completion_tokens - 1)


def test_messages_tool_choice_any(oss: Running) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"messages": HELLO, "tools": tools, "tool_choice": {"type": "any"}, "max_tokens": 200}
    m = post(oss, "/v1/messages", {**body, "temperature": 0}).json()
    assert m["stop_reason"] == "tool_use", m
    [use] = [b for b in m["content"] if b["type"] == "tool_use"]
    check_args(use["name"], use["input"])
    assert all(not any(mk in b.get("text", "") for mk in MARKUP) for b in m["content"])


def test_budget_steering_closes_the_call_in_harmony(oss: Running) -> None:
    """The random model writes a long free string: near max_tokens the budget steering closes the
    string, the object and the message with `<|call|>`, and the reply says so (length, closed_to_fit)
    while its call is whole, as a Hermes call steered closed is."""
    note = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    tools = [{"type": "function", "function": {"name": "take_note", "parameters": note}}]
    body = {"tools": tools, "tool_choice": "required", "temperature": 1.0, "seed": 0, "max_tokens": 60}
    choice = chat(oss, logprobs=True, **body)["choices"][0]
    assert (choice["finish_reason"], choice["native_finish_reason"]) == ("length", "closed_to_fit"), choice
    [call] = choice["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"note"}
    assert written(choice).startswith(HEAD.format("take_note"))
    calls, content, reason = streamed(oss, **body)
    assert (calls, content, reason) == (
        [{"name": "take_note", "arguments": call["function"]["arguments"]}],
        "",
        "length",
    )


@pytest.mark.parametrize("seed", [None, 3])
def test_response_format_is_the_final_message(oss: Running, seed: int | None) -> None:
    """A JSON schema on a harmony model constrains a `final` message (not the channel header the model
    writes first): `content` is the document alone, streamed as unstreamed, no markup leaks."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    body: dict[str, Any] = {"response_format": fmt, "logprobs": True}
    if seed is not None:
        body |= {"temperature": 1.0, "seed": seed}
    r = post(oss, "/v1/chat/completions", {"messages": HELLO, "temperature": 0, **body})
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    check_args("get_weather", content)
    assert choice["finish_reason"] == "stop" and not choice["message"].get("reasoning_content")
    assert written(choice) == "<|channel|>final<|message|>" + content
    stream = {"messages": HELLO, "temperature": 0, "stream": True, **body}
    chunks = [c for c in sse_payloads(post(oss, "/v1/chat/completions", stream).text) if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content
