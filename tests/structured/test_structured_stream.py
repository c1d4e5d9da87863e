"""Tool calls streamed as OpenAI streams them: the first delta of a call has its index, id, type and
name, later deltas append pieces of its arguments as the model writes them, and the pieces assemble
to exactly the arguments of the same reply unstreamed. On text fed a few characters at a time (as
tokens come), for each way a call can start; through the server in test_structured.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from localllm.engine.output import StepOutput
from localllm.server.tool_calls import ToolPlan
from localllm.server.tool_stream import ToolStream
from localllm.structured.call_scanner import CallScanner
from localllm.structured.tools import FAMILIES

FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
ARGS = '{"city": "Paris \\"Ville\\" {x}", "days": [1, {"a": 2}], "metric": true}'


class Deltas:
    """Stands in for streaming.ChunkBuilder: each chunk is its delta (and the finish reason)."""

    def chat_delta(self, index: int, delta: dict[str, Any], finish: str | None = None) -> Any:
        return {**delta, "finish": finish} if finish else delta


def plan(
    choice: str = "auto", family: str = "hermes", parallel: bool = True, legacy: bool = False
) -> ToolPlan:
    named = "get_weather" if choice == "named" else None
    return ToolPlan(FUNCTIONS, choice, named, parallel, legacy, FAMILIES[family], True)


def stream(p: ToolPlan, text: str, step: int = 3) -> list[dict[str, Any]]:
    """The deltas of `text` arriving `step` characters at a time."""
    s = ToolStream(p, Deltas())
    out: list[dict[str, Any]] = []
    for i in range(0, len(text), step):
        last = i + step >= len(text)
        o = StepOutput("r", text[i : i + step], 1, None, last, "stop" if last else None, 1, 0, 1, None, 0.0)
        out += list(s.chat_output(o))
    return out


def assembled(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the openai client accumulates from the tool_calls deltas (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": c.get("id"), "name": "", "arguments": ""})
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def arg_pieces(deltas: list[dict[str, Any]]) -> list[str]:
    return [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []) if "id" not in c]


def check_like_unstreamed(p: ToolPlan, text: str, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    message, reason = p.reply(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    got = assembled(deltas)
    assert [(c["name"], c["arguments"]) for c in got] == want
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert all(h["type"] == "function" and h["function"]["arguments"] == "" for h in heads)
    assert deltas[-1]["finish"] == reason == "tool_calls"
    return got


@pytest.mark.parametrize("step", [1, 2, 5])
def test_hermes_call_streams_its_arguments_in_pieces(step: int) -> None:
    text = f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
    deltas = stream(plan(), text, step)
    got = check_like_unstreamed(plan(), text, deltas)
    assert got[0]["arguments"] == ARGS  # the model's own text, as the unstreamed reply has it
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n"
    pieces = arg_pieces(deltas)
    assert len(pieces) > 3 and "".join(pieces) == ARGS
    # the first piece went out long before the reply ended
    first = next(i for i, d in enumerate(deltas) if arg_pieces([d]))
    assert first < len(deltas) - 5


def test_parallel_calls_get_their_own_index() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    got = check_like_unstreamed(plan(), text, stream(plan(), text))
    assert [c["name"] for c in got] == ["get_weather", "get_time"] and got[0]["id"] != got[1]["id"]
    one = stream(plan(parallel=False), text)  # parallel_tool_calls false: the first call only
    assert [c["name"] for c in assembled(one)] == ["get_weather"]


@pytest.mark.parametrize("prefix", ["", "```json\n", "  "])
def test_bare_call_streams_once_its_name_is_a_function(prefix: str) -> None:
    body = f'{{"name": "get_weather", "arguments": {ARGS}}}'
    text = prefix + body + ("\n```" if prefix.startswith("`") else "")
    deltas = stream(plan(), text, 2)
    check_like_unstreamed(plan(), text, deltas)
    assert len(arg_pieces(deltas)) > 3 and not any("content" in d for d in deltas)


def test_an_object_that_is_no_call_is_content() -> None:
    text = '{"city": "Paris", "note": "not a call"}'
    deltas = stream(plan(), text, 2)
    assert "".join(d.get("content", "") for d in deltas) == text
    assert not any("tool_calls" in d for d in deltas) and deltas[-1]["finish"] == "stop"
    other = '{"name": "unknown_tool", "arguments": {}}'
    assert "".join(d.get("content", "") for d in stream(plan(), other, 2)) == other


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_stream_in_pieces(choice: str) -> None:
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
    deltas = stream(plan(choice), text, 2)
    check_like_unstreamed(plan(choice), text, deltas)
    assert len(arg_pieces(deltas)) > 3
    llama = plan(choice, "llama3")  # Llama 3: a bare object with "parameters"
    text = f'{{"name": "get_weather", "parameters": {ARGS}}}'
    deltas = stream(llama, text, 2)
    check_like_unstreamed(llama, text, deltas)
    assert len(arg_pieces(deltas)) > 3


def test_legacy_function_call_streams_in_pieces() -> None:
    p = plan("named", parallel=False, legacy=True)
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
    deltas = stream(p, text, 2)
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert calls[0] == {"name": "get_weather", "arguments": ""} and len(calls) > 3
    assert "".join(c["arguments"] for c in calls) == ARGS and deltas[-1]["finish"] == "function_call"


def test_mistral_calls_come_whole_at_the_end() -> None:
    p = plan("auto", "mistral")
    text = 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    deltas = stream(p, text, 2)
    check_like_unstreamed(p, text, deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Sure."


def test_a_call_cut_short_keeps_what_was_streamed() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    s = ToolStream(plan(), Deltas())
    deltas = list(s.chat_output(StepOutput("r", text, 1, None, False, None, 1, 0, 1, None, 0.0)))
    deltas += list(s.chat_output(StepOutput("r", "", 1, None, True, "length", 1, 0, 2, None, 0.0)))
    assert assembled(deltas)[0]["arguments"] == '{"city": "Par' and deltas[-1]["finish"] == "length"


def test_scanner_finds_name_and_raw_arguments() -> None:
    s = CallScanner()
    s.feed(f' {{"arguments": {ARGS}, "name": "f", "n": 12 }} trailing')
    assert (s.name, s.arguments(), s.done) == ("f", (ARGS, True), True)
    assert s.text[s.end :] == " trailing"
    s = CallScanner()
    s.feed('{"name": "f", "arguments": "{\\"q\\": 1}"}')  # arguments as a JSON string: not streamed raw
    assert s.name == "f" and s.arguments() is None
    s = CallScanner()
    s.feed("hello")
    assert s.failed
    assert json.loads(ARGS)  # the fixture itself is valid JSON
