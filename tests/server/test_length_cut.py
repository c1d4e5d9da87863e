"""A reply cut by a length limit says so on every endpoint, whatever it holds: `length` (chat,
completions), `max_tokens` (Messages), `incomplete` (Responses). A tool call it cut is never sent as
text nor as a call with cut arguments; streamed, the call's deltas stop and the final chunk says
`length`. On the tiny model, whose forced call (tool_choice required) is cut at budgets from inside the
start marker to inside the end marker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import CHAT, MODEL_ID, Running, engine_factory, post, running_server, sse_payloads

from localllm.structured.tools import FAMILIES

PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
FORCED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
MARKUP = ("<tool_call", "</tool_call", '{"name"', "<tool")


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, ctx_size=1024)) as running:
        yield running


@pytest.fixture(scope="module")
def whole(srv: Running) -> int:
    """The tokens of the forced call written in full (its last one closes `</tool_call>`)."""
    r = post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 200, **FORCED}).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls", r
    return r["usage"]["completion_tokens"]


def budgets(whole: int) -> list[int]:
    """From inside the start marker, through the name and the arguments, to inside the end marker."""
    return [4, 20, whole // 2, whole - 12, whole - 3, whole - 1]


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        out.append((name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return out


# ------------------------------------------------------------------------------------------ chat


def test_chat_cut_call_is_length_and_never_text(srv: Running, whole: int) -> None:
    kept = 0
    for max_tokens in budgets(whole):
        r = post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": max_tokens, **FORCED}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "length", (max_tokens, choice)
        assert no_markup(choice["message"]["content"]), (max_tokens, choice)
        for call in choice["message"].get("tool_calls") or []:
            assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
            kept += 1
    # a call whose JSON was whole but whose end marker was cut is kept (with "length")
    assert kept >= 1


def test_chat_stream_cut_call_stops_and_says_length(srv: Running, whole: int) -> None:
    for max_tokens in budgets(whole):
        body = {"messages": CHAT, "max_tokens": max_tokens, "stream": True, **FORCED}
        chunks = sse_payloads(post(srv, "/v1/chat/completions", body).text)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert no_markup("".join(d.get("content") or "" for d in deltas)), max_tokens
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", max_tokens
        args = "".join(
            d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d
        )
        unstreamed = post(srv, "/v1/chat/completions", {**body, "stream": False}).json()["choices"][0]
        calls = unstreamed["message"].get("tool_calls")
        if calls:  # whole arguments: streamed in full, as the unstreamed reply has them
            assert args == calls[0]["function"]["arguments"]
        else:  # cut ones: the deltas stopped where the reply did
            with pytest.raises(json.JSONDecodeError):
                json.loads(args)


def test_text_then_cut_call_keeps_only_the_text(srv: Running) -> None:
    """tool_choice auto: text, then a call the limit cuts (a regex makes the tiny model write them)."""
    regex = r'hi there <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{40}'
    body = {"messages": CHAT, "tools": [WEATHER], "max_tokens": 30, "guided_regex": regex}
    r = post(srv, "/v1/chat/completions", body).json()["choices"][0]
    assert (r["finish_reason"], r["message"]["content"]) == ("length", "hi there ")
    assert "tool_calls" not in r["message"]
    chunks = sse_payloads(post(srv, "/v1/chat/completions", {**body, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "hi there "
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


class Weather(BaseModel):
    city: str
    unit: str


def test_openai_parse_raises_on_a_cut_call(srv: Running, whole: int) -> None:
    client = srv.client()
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL_ID, messages=CHAT, tools=[tool], tool_choice="required", max_tokens=whole - 1
        )


FREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "items": {"type": "object"}},
    "required": ["name", "items"],
}


class Free(BaseModel):
    name: str
    items: dict


def test_steered_document_says_length_and_names_the_steering(srv: Running) -> None:
    """The random model writes a long string: budget steering closes the document in time (valid
    JSON), and the reply says so, so that the openai client's parse() raises instead of accepting."""
    rf = {"type": "json_schema", "json_schema": {"name": "free", "schema": FREE}}
    body = {"messages": CHAT, "max_tokens": 64, "temperature": 1.0, "seed": 0, "response_format": rf}
    choice = post(srv, "/v1/chat/completions", body).json()["choices"][0]
    assert (choice["finish_reason"], choice["native_finish_reason"]) == ("length", "closed_to_fit")
    assert set(json.loads(choice["message"]["content"])) == {"name", "items"}
    chunks = sse_payloads(post(srv, "/v1/chat/completions", {**body, "stream": True}).text)
    assert chunks[-1]["choices"][0]["native_finish_reason"] == "closed_to_fit"
    with pytest.raises(openai.LengthFinishReasonError):
        srv.client().chat.completions.parse(
            model=MODEL_ID, messages=CHAT, max_tokens=64, temperature=1.0, seed=0, response_format=Free
        )
    # greedy (Responses and Messages take no seed): steered or stopped by the loop guard, cut either way
    greedy = post(srv, "/v1/chat/completions", {**body, "temperature": 0}).json()["choices"][0]
    assert greedy["finish_reason"] == "length" and greedy["native_finish_reason"] in (
        "closed_to_fit",
        "repetition",
    )
    schema = {"type": "json_schema", "name": "free", "schema": FREE}
    r = post(
        srv,
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 64, "temperature": 0, "text": {"format": schema}},
    )
    assert r.json()["status"] == "incomplete"
    m = {
        "messages": CHAT,
        "max_tokens": 64,
        "output_config": {"format": {"type": "json_schema", "schema": FREE}},
    }
    assert post(srv, "/v1/messages", {**m, "temperature": 0}).json()["stop_reason"] == "max_tokens"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)
    kind: Literal["cat", "dog", "bird"]
    tags: list[Literal["old", "new", "small"]] = Field(max_length=2)


class Spot(BaseModel):  # the tiny model's prompt with a tool nearly fills its context: a short call
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)


FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)  # x the answer's own length, as scripts/steering_check.py


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_openai_parse_raises_or_returns_the_full_values(srv: Running, seed: int) -> None:
    """Issue 34's target through the official client: at budgets from 0.5x to 3x the answer's length,
    chat.completions.parse() raises LengthFinishReasonError or returns exactly the values the model
    writes with room to spare (each position's draw depends on the seed only, so the replies agree up
    to where a budget changes one) - never a value cut or emptied by the budget steering."""
    client = srv.client()
    kw = {"model": MODEL_ID, "messages": CHAT, "temperature": 1.0, "seed": seed}
    room = client.chat.completions.parse(**kw, response_format=Pet, max_tokens=400)
    assert room.choices[0].finish_reason == "stop"
    full, n = room.choices[0].message.parsed, room.usage.completion_tokens
    outcomes = []
    for factor in FACTORS:
        try:
            reply = client.chat.completions.parse(**kw, response_format=Pet, max_tokens=round(factor * n))
            assert reply.choices[0].message.parsed == full, (factor, reply)
            outcomes.append("same")
        except openai.LengthFinishReasonError:
            outcomes.append("raised")
    assert outcomes[FACTORS.index(1.0) :] == ["same"] * 5 and outcomes[0] == "raised", outcomes


def test_openai_parse_of_a_forced_call_raises_or_returns_the_full_arguments(srv: Running) -> None:
    """The same for a forced call's parsed arguments (from 1x on, the model's call as it is)."""
    client = srv.client()
    tool = openai.pydantic_function_tool(Spot, name="plan_trip")
    kw = {"model": MODEL_ID, "messages": CHAT, "temperature": 1.0, "seed": 0}
    call_kw = {**kw, "tools": [tool], "tool_choice": "required"}
    roomy_call = client.chat.completions.parse(**call_kw, max_tokens=300)
    assert roomy_call.choices[0].finish_reason == "tool_calls"
    full_args = roomy_call.choices[0].message.tool_calls[0].function.parsed_arguments
    m = roomy_call.usage.completion_tokens
    for factor in FACTORS:
        try:
            reply = client.chat.completions.parse(**call_kw, max_tokens=min(300, round(factor * m)))
        except openai.LengthFinishReasonError:
            assert factor < 1.0
            continue
        assert reply.choices[0].message.tool_calls[0].function.parsed_arguments == full_args, factor


def test_completions_cut_says_length(srv: Running) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "logit_bias": {"0": -100, "1": -100, "2": -100}}
    assert post(srv, "/v1/completions", body).json()["choices"][0]["finish_reason"] == "length"
    chunks = sse_payloads(post(srv, "/v1/completions", {**body, "stream": True}).text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -------------------------------------------------------------------------------------- messages


def test_messages_cut_call_is_max_tokens(srv: Running, whole: int) -> None:
    tool = {"name": "get_weather", "input_schema": PARAMS}
    base = {"messages": CHAT, "tools": [tool], "tool_choice": {"type": "any"}, "temperature": 0}
    kept = 0
    for max_tokens in budgets(whole):
        m = post(srv, "/v1/messages", {**base, "max_tokens": max_tokens}).json()
        assert m["stop_reason"] == "max_tokens", (max_tokens, m)
        assert all(no_markup(b.get("text")) for b in m["content"]), m
        kept += sum(b["type"] == "tool_use" and set(b["input"]) == {"city", "unit"} for b in m["content"])
        events = named_events(
            post(srv, "/v1/messages", {**base, "max_tokens": max_tokens, "stream": True}).text
        )
        text = "".join(p["delta"].get("text", "") for name, p in events if name == "content_block_delta")
        assert no_markup(text)
        assert [p["delta"]["stop_reason"] for name, p in events if name == "message_delta"] == ["max_tokens"]
    assert kept >= 1


# ------------------------------------------------------------------------------------- responses


def test_responses_cut_call_is_incomplete(srv: Running, whole: int) -> None:
    base = {"input": "weather?", "tools": [{"type": "function", **WEATHER["function"]}], "temperature": 0}
    base |= {"tool_choice": "required", "parallel_tool_calls": False}
    for max_tokens in budgets(whole):
        r = post(srv, "/v1/responses", {**base, "max_output_tokens": max_tokens}).json()
        assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"}), r
        for item in r["output"]:
            if item["type"] == "message":
                assert all(no_markup(part["text"]) for part in item["content"]), r
            else:
                assert set(json.loads(item["arguments"])) == {"city", "unit"}
        body = {**base, "max_output_tokens": max_tokens, "stream": True}
        events = named_events(post(srv, "/v1/responses", body).text)
        assert events[-1][0] == "response.incomplete"
        done = events[-1][1]["response"]
        for item in done["output"]:
            if item["type"] == "message":
                assert all(no_markup(part["text"]) for part in item["content"])
            elif item["status"] == "completed":  # a call cut while written is marked incomplete
                assert set(json.loads(item["arguments"])) == {"city", "unit"}
        streamed = [p["delta"] for name, p in events if name == "response.output_text.delta"]
        assert no_markup("".join(streamed))


# ------------------------------------------------------------------------------------ the parsers


@pytest.mark.parametrize(
    "family,text,kept",
    [
        ("hermes", 'ok <tool_call>\n{"name": "f", "argu', "ok "),
        ("hermes", "ok <tool_", "ok "),
        (
            "hermes",
            'ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool',
            'ok <tool_call>\n{"name": "f", "arguments": {}}\n',
        ),
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na',
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n',
        ),
        ("hermes", '{"name": "f", "arguments": {"a": 1', ""),
        ("hermes", '```json\n{"name": "f", "arg', ""),
        ("hermes", '{"answer": 4', '{"answer": 4'),
        ("hermes", "plain text cut mid-word", "plain text cut mid-word"),
        ("mistral", 'hi [TOOL_CALLS][{"name": "f", "arguments": {}}, {"name"', "hi "),
        ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x"', ""),
        ("llama3", '{"name": "f", "parameters": {"x"', ""),
        ("llama3", '{"name": "g", "parameters": {"x"', '{"name": "g", "parameters": {"x"'),
    ],
)
def test_before_cut_call(family: str, text: str, kept: str) -> None:
    assert FAMILIES[family].before_cut_call(text, {"f"}) == kept
