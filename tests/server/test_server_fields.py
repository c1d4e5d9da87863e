"""Nothing silent: every documented OpenAI request field of /v1/chat/completions and /v1/completions is
honoured, accepted as a listed no-op, or refused with a 400 naming it; unknown fields are refused too.
Also model names: --alias names are served and listed, unknown ones are OpenAI's 404."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import (
    BAN_END,
    CHAT,
    MODEL_ID,
    Running,
    engine_factory,
    error_of,
    post,
    running_server,
    sse_payloads,
)

from localllm.server.protocol import ChatCompletionRequest, CompletionRequest

ALIASES = ("gpt-4o-mini", "my-model")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# OpenAI's documented request fields (API reference), each with a value a client would send.
CHAT_HONOURED: dict[str, Any] = {
    "model": MODEL_ID,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 1},
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 2,
    "max_tokens": 2,
    "n": 2,
    "seed": 3,
    "stop": ["zz"],
    "stream": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.5,
    "top_p": 0.9,
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "reasoning_effort": "low",  # passed to the chat template (gpt-oss reads it)
    "chat_template_kwargs": {"enable_thinking": False},  # extension (vLLM)
    "reasoning_budget": 16,  # extension
    "modalities": ["text"],
    "tools": [TOOL],
    "parallel_tool_calls": False,
}
CHAT_NOOPS: dict[str, Any] = {
    "user": "u1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "s1",
    "prompt_cache_key": "k1",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
}
CHAT_REFUSED: list[tuple[str, Any]] = [
    ("tools", [{"type": "retrieval"}]),
    ("tool_choice", "required"),  # without tools
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("function_call", {"name": "f"}),  # without functions
    ("functions", [{"name": "not a name"}]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "extreme"),
    ("chat_template_kwargs", {"messages": []}),  # the server's own variables are not replaced
    ("reasoning_budget", -2),
    ("verbosity", "low"),
    ("web_search_options", {}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
    ("response_format", {"type": "sound"}),
    ("unknown_field", 1),
]
COMPLETION_HONOURED: dict[str, Any] = {
    "model": MODEL_ID,
    "best_of": 1,
    "echo": True,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 1},
    "logprobs": 2,
    "max_tokens": 2,
    "n": 2,
    "seed": 3,
    "stop": "zz",
    "stream": False,
    "stream_options": {"include_usage": True},
    "suffix": "",
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u1",
}
COMPLETION_REFUSED: list[tuple[str, Any]] = [
    ("suffix", " return x"),
    ("best_of", 2),
    ("unknown_field", 1),
]


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    factory = engine_factory(tiny_model_path, index_dir, ctx_size=1024)  # room for tool definitions
    with running_server(factory, served_aliases=ALIASES) as running:
        yield running


def test_every_documented_field_is_declared() -> None:
    """A documented field the models do not declare would be refused as unknown; none is."""
    chat = set(CHAT_HONOURED) | set(CHAT_NOOPS) | {name for name, _ in CHAT_REFUSED} - {"unknown_field"}
    assert chat <= set(ChatCompletionRequest.model_fields)
    completion = set(COMPLETION_HONOURED) | {name for name, _ in COMPLETION_REFUSED} - {"unknown_field"}
    assert completion <= set(CompletionRequest.model_fields)


def test_the_openai_clients_fields_are_all_covered() -> None:
    """Every parameter the installed `openai` package can send is in the lists above, so a field added
    to OpenAI's API shows up here instead of being refused as unknown without anyone deciding."""
    from openai.types import completion_create_params as legacy
    from openai.types.chat import completion_create_params as chat

    chat_listed = {*CHAT_HONOURED, *CHAT_NOOPS, *(name for name, _ in CHAT_REFUSED), "messages"}
    assert set(typing.get_type_hints(chat.CompletionCreateParamsBase)) <= chat_listed
    legacy_listed = {*COMPLETION_HONOURED, "prompt"}
    assert set(typing.get_type_hints(legacy.CompletionCreateParamsBase)) <= legacy_listed


@pytest.mark.parametrize("name", sorted({**CHAT_HONOURED, **CHAT_NOOPS}))
def test_chat_field_accepted(srv: Running, name: str) -> None:
    body = {"messages": CHAT, "max_tokens": 2, name: {**CHAT_HONOURED, **CHAT_NOOPS}[name]}
    if name == "top_logprobs":
        body["logprobs"] = True
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


def test_all_chat_fields_together(srv: Running) -> None:
    r = post(srv, "/v1/chat/completions", {"messages": CHAT, **CHAT_HONOURED, **CHAT_NOOPS})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize(
    "name,value", CHAT_REFUSED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CHAT_REFUSED)]
)
def test_chat_field_refused_by_name(srv: Running, name: str, value: Any) -> None:
    for stream in (False, True):
        r = post(
            srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": stream, name: value}
        )
        err = error_of(r, 400)
        assert err["param"] == name and err["type"] == "invalid_request_error"
        assert name in err["message"]


def test_sound_response_format_message(srv: Running) -> None:
    body = {"messages": CHAT, "response_format": {"type": "sound"}}
    assert "json_schema" in error_of(post(srv, "/v1/chat/completions", body), 400)["message"]


def test_legacy_functions_accepted(srv: Running) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "functions": [TOOL["function"]], "function_call": "none"}
    assert post(srv, "/v1/chat/completions", body).status_code == 200


def test_nested_unknown_field_refused(srv: Running) -> None:
    body = {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}}
    assert error_of(post(srv, "/v1/chat/completions", body), 400)["param"] == "stream_options.bogus"
    assert error_of(post(srv, "/tokenize", {"prompt": "x", "bogus": 1}), 400)["param"] == "bogus"


def test_completion_fields(srv: Running) -> None:
    r = post(srv, "/v1/completions", {"prompt": "abc", **COMPLETION_HONOURED})
    assert r.status_code == 200, r.text
    for name, value in COMPLETION_REFUSED:
        err = error_of(post(srv, "/v1/completions", {"prompt": "abc", "max_tokens": 2, name: value}), 400)
        assert err["param"] == name and name in err["message"]


def test_openai_client_sees_refusals(srv: Running) -> None:
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=CHAT, tools=[TOOL], tool_choice={"x": 1})
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=CHAT, extra_body={"frobnicate": True})
    assert e.value.param == "frobnicate"


def test_aliases_served_and_listed(srv: Running) -> None:
    client = srv.client()
    assert [m.id for m in client.models.list().data] == [MODEL_ID, *ALIASES]
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    r = client.chat.completions.create(model="gpt-4o-mini", messages=CHAT, max_tokens=1)
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"


def test_alias_flag_in_help() -> None:
    from typer.testing import CliRunner

    import localllm.cli.serve  # noqa: F401  (registers the command)
    from localllm.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--alias" in result.output and '"max_tokens": 32' in result.output


# ------------------------------------------------------------------------------------ legacy completions


def test_prompt_list_gives_a_choice_per_prompt_in_order(srv: Running) -> None:
    client = srv.client()
    prompts = ["The quick brown fox", "Once upon a time", "abc"]
    kw = {"model": MODEL_ID, "max_tokens": 5, "temperature": 0}
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    ids = [srv.engine.tokenize_prompt(p) for p in prompts]
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    assert client.completions.create(prompt=ids, **kw).choices[1].text == singles[1]
    streamed = ["", "", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == singles
    srv.wait_idle()


def test_echo_with_logprobs_scores_the_prompt(srv: Running) -> None:
    client = srv.client()
    ids = srv.engine.tokenize_prompt("The quick brown fox")
    kw = {"model": MODEL_ID, "temperature": 0, "logit_bias": BAN_END}
    gen = client.completions.create(prompt=ids, max_tokens=3, logprobs=2, **kw).choices[0].logprobs
    echo = client.completions.create(prompt=ids, max_tokens=3, logprobs=2, echo=True, **kw).choices[0]
    lp = echo.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.token_logprobs[len(ids) :] == gen.token_logprobs
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    # scoring the prompt plus what greedy generated gives the logprobs the generation reported
    generated = [srv.engine.tokenizer.encode(t, False, True)[0] for t in gen.tokens]
    scored = client.completions.create(prompt=ids + generated, max_tokens=0, logprobs=0, echo=True, **kw)
    assert scored.choices[0].logprobs.token_logprobs[-3:] == pytest.approx(gen.token_logprobs, abs=1e-4)
    srv.wait_idle()


def test_max_tokens_zero_with_echo_only_scores(srv: Running) -> None:
    body = {"prompt": ["Hello world", "abc"], "max_tokens": 0, "echo": True, "logprobs": 1}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["text"] for c in data["choices"]] == ["Hello world", "abc"]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 0 and data["usage"]["prompt_tokens"] > 0
    n = len(srv.engine.tokenize_prompt("Hello world"))
    assert len(data["choices"][0]["logprobs"]["token_logprobs"]) == n
    payloads = sse_payloads(post(srv, "/v1/completions", {**body, "stream": True}).text)
    texts = {p["choices"][0]["index"]: p["choices"][0]["text"] for p in payloads if p["choices"][0]["text"]}
    assert texts == {0: "Hello world", 1: "abc"}
    plain = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 0}).json()["choices"][0]
    assert plain["text"] == "" and plain["finish_reason"] == "length"
    srv.wait_idle()


def test_scoring_between_steps_of_running_requests(srv: Running) -> None:
    """Prompt scoring runs on the engine thread between steps: busy or idle, the same numbers."""
    body = {"prompt": "score me while busy", "max_tokens": 0, "echo": True, "logprobs": 0}
    idle = post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
    long = {"prompt": "keep busy", "max_tokens": 200, "stream": True, "logit_bias": BAN_END}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # generation is under way
        busy = post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and len(rest) > 100  # the stream went on to its end
    assert busy == pytest.approx(idle, abs=1e-5)
    srv.wait_idle()
