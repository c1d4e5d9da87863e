"""Thinking kept out of the answer on every chat endpoint, with tiny models whose replies are scripted
(tiny_think.py): the official `openai` client reads `reasoning_content` (streamed or not, alike), the
`anthropic` client gets `thinking` blocks, Responses a `reasoning` item; chat_template_kwargs,
reasoning_effort and reasoning budgets reach the template and the engine; tool calls after thinking
still parse; earlier turns' thinking is accepted and given to the template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from server_harness import Running, engine_factory, post, running_server, sse_payloads
from tiny_think import reply_ids, script_replies, write_harmony_model, write_think_model

HELLO = [{"role": "user", "content": "hello"}]
REPLY = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
REPLIES = {  # by the request's seed
    None: REPLY,
    1: "<think>\nCheck the weather tool.\n</think>\n\n" + CALL,
    2: "<think>\n" + "Long thought, " * 40 + "\n</think>\n\nDone.",
}


def scripted(running: Running, replies: dict[Any, str]) -> None:
    ids = {seed: reply_ids(running.engine, text) for seed, text in replies.items()}
    script_replies(running.engine, lambda seq: ids.get(seq.params.seed, ids[None]))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> Iterator[Running]:
    path = write_think_model(tmp_path_factory.mktemp("think") / "think.gguf")
    with running_server(engine_factory(path, index_dir, ctx_size=1024), model_id="think") as running:
        scripted(running, REPLIES)
        yield running


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> Iterator[Running]:
    path = write_harmony_model(tmp_path_factory.mktemp("harmony") / "harmony.gguf")
    with running_server(engine_factory(path, index_dir, ctx_size=1024), model_id="oss") as running:
        yield running


def chat(srv: Running, **body: Any) -> dict[str, Any]:
    r = post(srv, "/v1/chat/completions", {"messages": HELLO, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(srv: Running, **body: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """(reasoning, content, chunks) of a streamed chat reply, joined from its deltas."""
    r = post(srv, "/v1/chat/completions", {"messages": HELLO, "stream": True, **body})
    assert r.status_code == 200, r.text
    chunks = sse_payloads(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas), chunks


# ------------------------------------------------------------------------------- chat completions


def test_openai_client_reads_reasoning_content(srv: Running) -> None:
    client = srv.client()
    done = client.chat.completions.create(model="think", messages=HELLO)  # type: ignore[arg-type]
    message = done.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content == "The user greets me. I greet back."  # type: ignore[attr-defined]
    details = done.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.reasoning_tokens > 0
    stream = client.chat.completions.create(model="think", messages=HELLO, stream=True)  # type: ignore[arg-type]
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13, 21, None])
def test_streamed_and_unstreamed_alike(srv: Running, max_tokens: int | None) -> None:
    """Cut anywhere (inside the think block too), the stream's deltas join to the unstreamed reply."""
    done = chat(srv, max_tokens=max_tokens)["choices"][0]["message"]
    reasoning, content, _ = streamed(srv, max_tokens=max_tokens)
    assert (reasoning, content) == (done.get("reasoning_content", ""), done["content"])
    assert "<think>" not in content and "</think>" not in content


def test_a_reply_cut_inside_its_thinking_is_all_reasoning(srv: Running) -> None:
    choice = chat(srv, max_tokens=6)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert "The user greets me".startswith(choice["message"]["reasoning_content"])


def test_tool_calls_after_thinking(srv: Running) -> None:
    message = chat(srv, seed=1, tools=TOOLS)["choices"][0]["message"]
    assert message["reasoning_content"] == "Check the weather tool."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    reasoning, content, chunks = streamed(srv, seed=1, tools=TOOLS)
    assert reasoning == "Check the weather tool." and content == ""
    pieces = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    args = "".join(p[0]["function"].get("arguments", "") for p in pieces if p)
    assert args == '{"city": "Oslo"}' and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_budget_closes_the_thinking(srv: Running) -> None:
    body = chat(srv, seed=2, reasoning_budget=4)
    message = body["choices"][0]["message"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    assert "Long thought, ".startswith(message["reasoning_content"]) and message["content"]
    assert "</think>" not in message["content"]


def test_server_wide_budget(tmp_path: Path, index_dir: Path) -> None:
    path = write_think_model(tmp_path / "think.gguf")
    factory = engine_factory(path, index_dir, ctx_size=1024)
    with running_server(factory, model_id="think", reasoning_budget=3) as running:
        scripted(running, REPLIES)
        assert chat(running)["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
        unlimited = chat(running, reasoning_budget=-1)  # the request's own budget wins
        assert unlimited["choices"][0]["message"]["reasoning_content"] == "The user greets me. I greet back."


def test_chat_template_kwargs_reach_the_template(srv: Running) -> None:
    """enable_thinking=false makes the Qwen3-like template write an empty think block into the prompt."""
    on = chat(srv, max_tokens=1)["usage"]["prompt_tokens"]
    off = chat(srv, max_tokens=1, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert off - on == len(reply_ids(srv.engine, "<think>\n\n</think>\n\n"))


def test_past_reasoning_goes_to_the_template(srv: Running) -> None:
    """An assistant turn after the last user message shows its reasoning_content (the template decides)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    tail = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plain = post(srv, "/v1/chat/completions", {"messages": [*HELLO, turn, *tail], "max_tokens": 1})
    thought = {**turn, "reasoning_content": "I should call it."}
    shown = post(srv, "/v1/chat/completions", {"messages": [*HELLO, thought, *tail], "max_tokens": 1})
    extra = shown.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert extra == len(reply_ids(srv.engine, "<think>\nI should call it.\n</think>\n\n"))


# ---------------------------------------------------------------------------------- /v1/messages


def test_anthropic_client_gets_thinking_blocks(srv: Running) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    message = client.messages.create(model="think", max_tokens=200, messages=HELLO)  # type: ignore[arg-type]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user greets me. I greet back."  # type: ignore[union-attr]
    assert message.content[1].text == "Hello there!"  # type: ignore[union-attr]
    with client.messages.stream(model="think", max_tokens=200, messages=HELLO) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


def test_anthropic_thinking_param_and_past_thinking_blocks(srv: Running) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    budget = client.messages.create(
        model="think",
        max_tokens=200,
        messages=HELLO,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert budget.content[0].type == "thinking"
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    THOUGHT = {"type": "thinking", "thinking": "Call it.", "signature": "s"}  # noqa: N806
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [THOUGHT, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    counted = client.messages.count_tokens(model="think", messages=history)  # type: ignore[arg-type]
    redacted = [dict(history[1], content=[{"type": "redacted_thinking", "data": "abc"}, use])]
    without = client.messages.count_tokens(
        model="think",
        messages=[history[0], *redacted, history[2]],  # type: ignore[list-item]
    )
    shown = len(reply_ids(srv.engine, "<think>\nCall it.\n</think>\n\n"))
    assert counted.input_tokens - without.input_tokens == shown
    reply = client.messages.create(model="think", max_tokens=50, messages=history)  # type: ignore[arg-type]
    assert reply.content[0].type == "thinking"


def test_anthropic_thinking_disabled(srv: Running) -> None:
    body = {"messages": HELLO, "max_tokens": 50, "thinking": {"type": "disabled"}}
    r = post(srv, "/v1/messages", body)
    assert r.status_code == 200, r.text
    # the template wrote an empty block, and the budget of 0 closed the scripted one at once
    assert [b["type"] for b in r.json()["content"]] == ["text"]


# --------------------------------------------------------------------------------- /v1/responses


def test_responses_reasoning_item(srv: Running) -> None:
    client = srv.client()
    done = client.responses.create(model="think", input="hello", reasoning={"effort": "low"})
    kinds = [item.type for item in done.output]
    assert kinds == ["reasoning", "message"] and done.output_text == "Hello there!"
    item = done.output[0]
    assert item.content[0].text == "The user greets me. I greet back."  # type: ignore[union-attr,index]
    assert done.usage.output_tokens_details.reasoning_tokens > 0  # type: ignore[union-attr]
    events = list(client.responses.create(model="think", input="hello", stream=True))
    delta = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert delta == item.content[0].text  # type: ignore[union-attr,index]
    completed = next(e for e in events if e.type == "response.completed").response
    assert [i.type for i in completed.output] == kinds and completed.output_text == "Hello there!"


def test_responses_reasoning_input_item(srv: Running) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    text = [{"type": "reasoning_text", "text": "Hm."}]
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": text}
    out = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    base = {"input": [{"role": "user", "content": "weather?"}, call, out], "max_output_tokens": 1}
    plain = post(srv, "/v1/responses", base).json()["usage"]["input_tokens"]
    given = {**base, "input": [base["input"][0], thought, call, out]}
    r = post(srv, "/v1/responses", given)
    assert r.status_code == 200, r.text
    extra = r.json()["usage"]["input_tokens"] - plain
    assert extra == len(reply_ids(srv.engine, "<think>\nHm.\n</think>\n\n"))


# ------------------------------------------------------------------------------------------ harmony


def test_harmony_channels_and_call(harmony: Running) -> None:
    analysis = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    replies = {
        None: f"{analysis}<|channel|>final<|message|>It is sunny.",
        1: f"{analysis}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + '{"city":"Oslo"}',
    }
    scripted(harmony, replies)
    message = chat(harmony)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Need the weather.", "It is sunny.")
    reasoning, content, _ = streamed(harmony)
    assert (reasoning, content) == ("Need the weather.", "It is sunny.")
    called = chat(harmony, seed=1, tools=TOOLS)["choices"][0]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["reasoning_content"] == "Need the weather."
    assert json.loads(called["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_reasoning_effort_reaches_the_template(harmony: Running) -> None:
    scripted(harmony, {None: "<|channel|>final<|message|>ok"})
    low = chat(harmony, max_tokens=1, reasoning_effort="low")["usage"]["prompt_tokens"]
    high = chat(harmony, max_tokens=1, reasoning_effort="high")["usage"]["prompt_tokens"]
    medium = chat(harmony, max_tokens=1)["usage"]["prompt_tokens"]
    prompt = harmony.engine.tokenizer
    assert high - low == len(prompt.encode("high")) - len(prompt.encode("low"))
    assert medium - low == len(prompt.encode("medium")) - len(prompt.encode("low"))
