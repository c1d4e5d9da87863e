"""Structured output and tool calling on the tiny random model: whatever its random weights prefer,
the grammar decides which tokens may come, so the output is valid for its schema, regex or grammar,
and forced tool calls are valid calls. The parsers of each family's call syntax are checked on text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel
from server_harness import (
    CHAT,
    MODEL_ID,
    Running,
    engine_factory,
    error_of,
    post,
    running_server,
    sse_payloads,
)

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.errors import InvalidRequestError
from localllm.sampling_params import SamplingParams
from localllm.structured.spec import StructuredSpec
from localllm.structured.tools import FAMILIES, Tool, bare_call, tool_family


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: Literal[3, 4]


PET_SCHEMA = Pet.model_json_schema() | {"additionalProperties": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path, index_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1)
    )


def run(engine: LLMEngine, spec: StructuredSpec, max_tokens: int = 40, **kw: object) -> tuple[str, str]:
    params = SamplingParams(
        temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, structured=spec, **kw
    )
    out = engine.generate(["hello"], params)[0]
    return out.text, out.finish_reason or ""


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_is_valid(engine: LLMEngine, seed: int) -> None:
    text, reason = run(engine, StructuredSpec.json_schema(PET_SCHEMA), temperature=1.0, seed=seed)
    assert reason == "stop"  # the grammar ends the request once the document is complete
    Pet.model_validate_json(text)


FREE_DICT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "items": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["name", "items"],
}


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_budget_running_out_closes_the_document(engine: LLMEngine, seed: int) -> None:
    """A reply that would reach max_tokens inside its document (the random model writes a long string)
    is steered to close it in time: valid JSON, and a finish reason that says the steering changed it
    ("closed_to_fit", "length" on the wire), not "stop": its values are not all the model's."""
    text, reason = run(
        engine, StructuredSpec.json_schema(FREE_DICT), max_tokens=64, temperature=1.0, seed=seed
    )
    assert reason == "closed_to_fit", text
    assert set(json.loads(text)) >= {"name", "items"}


FITTING = [
    PET_SCHEMA,
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
            "n": {"type": "integer", "maximum": 99},
        },
        "required": ["tags", "n"],
    },
]


@pytest.mark.parametrize("schema", FITTING)
def test_a_document_that_fits_is_never_steered(engine: LLMEngine, schema: dict) -> None:
    """Budget steering changes nothing while the budget can hold the document as the model writes it:
    with max_tokens exactly the tokens the unconstrained-by-budget reply took, the reply is the same,
    and "stop". One token less cannot hold it: it ends steered (valid) or cut, never "stop"."""
    spec = StructuredSpec.json_schema(schema)
    params = {"temperature": 0.0, "structured": spec}
    free = engine.generate(["hello"], SamplingParams(max_tokens=400, **params))[0]
    assert free.finish_reason == "stop", free.text
    n = len(free.token_ids)
    exact = engine.generate(["hello"], SamplingParams(max_tokens=n, **params))[0]
    assert (exact.text, exact.finish_reason) == (free.text, "stop")
    short = engine.generate(["hello"], SamplingParams(max_tokens=n - 1, **params))[0]
    assert short.finish_reason in ("closed_to_fit", "length"), short.text
    if short.finish_reason == "closed_to_fit":
        json.loads(short.text)


def test_regex_and_gbnf_and_lark(engine: LLMEngine) -> None:
    text, reason = run(engine, StructuredSpec("regex", r"[ab]{3}-[0-9]{2}"))
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", text) and reason == "stop"
    text, _ = run(engine, StructuredSpec("grammar", 'root ::= "yes" | "no"'))
    assert text in ("yes", "no")
    text, _ = run(engine, StructuredSpec("lark", 'start: "x" ("y" | "z")'))
    assert text in ("xy", "xz")


def test_cut_by_max_tokens_says_length(engine: LLMEngine) -> None:
    text, reason = run(engine, StructuredSpec("regex", "[a-z]{40}"), max_tokens=3)
    assert reason == "length" and re.fullmatch("[a-z]+", text)
    text, _ = run(engine, StructuredSpec("json_object"), max_tokens=8)
    assert text.startswith("{")


def test_bad_grammar_is_a_user_error(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.add_request("hi", SamplingParams(structured=StructuredSpec("grammar", "root ::= (")))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredSpec.json_schema("{")


def test_logprobs_are_the_models_own(engine: LLMEngine) -> None:
    """The mask picks the token; the reported logprob is the unconstrained distribution's."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    free = engine.generate(["hello"], params)[0]
    forced = engine.generate(["hello"], SamplingParams(**{**_fields(params), "structured": _regex(free)}))[0]
    assert forced.token_ids[: len(free.token_ids)] == free.token_ids
    assert [lp.logprob for lp in forced.logprobs][:2] == pytest.approx(
        [lp.logprob for lp in free.logprobs][:2]
    )


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def _regex(out: object) -> StructuredSpec:
    return StructuredSpec("regex", re.escape(out.text) + ".*")  # type: ignore[attr-defined]


def test_overlap_gives_the_same_tokens(engine: LLMEngine) -> None:
    spec = StructuredSpec.json_schema(PET_SCHEMA)
    runner = engine.runner
    outs = []
    for overlap in (True, False):
        runner._masks.overlap = overlap
        outs.append(run(engine, spec, temperature=1.0, seed=5))
    runner._masks.overlap = True
    assert outs[0] == outs[1]


# ----------------------------------------------------------------------------------------- parsers


def test_family_from_template() -> None:
    assert tool_family("{{ '<tool_call>' }}").name == "hermes"
    assert tool_family("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert tool_family("<|start_header_id|>ipython ... <|python_tag|>").name == "llama3"
    assert tool_family("{{ messages }}").name == "hermes"  # the fallback


def test_parsers() -> None:
    hermes = (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g"'
    )
    content, calls = FAMILIES["hermes"].parse(hermes + ', "arguments": {}}\n</tool_call>')
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    _, calls = FAMILIES["llama3"].parse('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}')
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": "b"}
    _, calls = FAMILIES["mistral"].parse(
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    )
    assert [c.name for c in calls] == ["f", "g"]
    assert FAMILIES["hermes"].parse("no calls here") == ("no calls here", [])
    assert bare_call('```json\n{"name": "f", "arguments": {"x": 2}}\n```', {"f"}).name == "f"
    assert bare_call('{"name": "other", "arguments": {}}', {"f"}) is None


def test_family_grammars_compile(engine: LLMEngine) -> None:
    tools = [Tool("f", {"type": "object", "properties": {"x": {"type": "integer"}}})]
    for family in FAMILIES.values():
        engine.grammars.compile(family.grammar(tools, True, json.dumps))


# ------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, ctx_size=1024)) as running:
        yield running


def chat(srv: Running, **body: object) -> dict:
    r = post(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "max_tokens": 60, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_response_format_json_schema(srv: Running) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
    body = chat(srv, response_format=rf, temperature=1.0, seed=3)
    Pet.model_validate_json(body["choices"][0]["message"]["content"])
    parsed = srv.client().chat.completions.parse(
        model=MODEL_ID, messages=CHAT, response_format=Pet, max_tokens=60
    )
    assert isinstance(parsed.choices[0].message.parsed, Pet)


def test_extensions_on_completions(srv: Running) -> None:
    for field, value, check in [
        ("guided_regex", "[0-9]{4}", lambda t: re.fullmatch("[0-9]{4}", t)),
        ("guided_choice", ["red", "blue"], lambda t: t in ("red", "blue")),
        ("grammar", 'root ::= "a" "b"+', lambda t: re.fullmatch("ab+", t)),
        ("guided_json", PET_SCHEMA, Pet.model_validate_json),
    ]:
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 30, field: value})
        assert r.status_code == 200, r.text
        assert check(r.json()["choices"][0]["text"]), (field, r.json())


def test_constraint_errors_name_their_field(srv: Running) -> None:
    bad = {"messages": CHAT, "guided_grammar": "root ::= ("}
    assert error_of(post(srv, "/v1/chat/completions", bad), 400)["param"] == "guided_grammar"
    two = {"prompt": "x", "guided_regex": "a", "grammar": 'root ::= "a"'}
    assert error_of(post(srv, "/v1/completions", two), 400)["param"] == "grammar"
    odd = {"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": "x"}}
    assert error_of(post(srv, "/v1/chat/completions", odd), 400)["param"] == "tool_choice"
    rf = {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}}
    assert error_of(post(srv, "/v1/chat/completions", rf), 400)["param"] == "response_format"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_valid(srv: Running, choice: object) -> None:
    body = chat(srv, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=1, max_tokens=200)
    choice0 = body["choices"][0]
    assert choice0["finish_reason"] == "tool_calls", body
    for call in choice0["message"]["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")
        else:
            assert choice == "required" and call["function"]["name"] == "get_time"


class Unit(BaseModel):
    scale: Literal["C", "F"]


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    unit: Unit


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_tool_parameters_with_defs_work_for_every_tool_choice(srv: Running, choice: object) -> None:
    """What the openai client's pydantic_function_tool sends: parameters whose `$ref`s point into
    their own `$defs` (which used to be a 400 "Pointer '/$defs/Unit' does not exist" once forced)."""
    import openai

    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    assert "$defs" in json.dumps(tool["function"]["parameters"])
    # one call: parallel ones may go on until max_tokens cuts the reply, which then says "length"
    body = chat(
        srv,
        tools=[tool],
        tool_choice=choice,
        temperature=1.0,
        seed=2,
        max_tokens=150,
        parallel_tool_calls=False,
    )
    for call in body["choices"][0]["message"].get("tool_calls") or []:
        if call["function"]["name"] == "forecast":
            Forecast.model_validate_json(call["function"]["arguments"])
    if choice != "auto":
        assert body["choices"][0]["finish_reason"] == "tool_calls", body


def test_tool_calls_stream_like_openai(srv: Running) -> None:
    body = {"model": MODEL_ID, "messages": CHAT, "max_tokens": 200, "stream": True, "tools": [WEATHER]}
    r = post(srv, "/v1/chat/completions", {**body, "tool_choice": "required", "parallel_tool_calls": False})
    chunks = sse_payloads(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads("".join(c["function"]["arguments"] for c in calls))["city"] in ("Paris", "Rome")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    client = srv.client()  # the openai client reassembles the same call
    stream = client.chat.completions.create(**{**body, "tool_choice": "required"})
    names = [
        c.choices[0].delta.tool_calls[0].function.name
        for c in stream
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert "get_weather" in names


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_arguments_come_in_pieces_and_match(srv: Running, choice: object) -> None:
    """The openai client's streaming helper sees the arguments grow delta by delta, and they assemble
    to the arguments of the same reply unstreamed (same seed)."""
    client = srv.client()
    body = {"model": MODEL_ID, "messages": CHAT, "max_tokens": 200, "tools": [WEATHER], "tool_choice": choice}
    body |= {"temperature": 1.0, "seed": 5, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        streamed = stream.get_final_completion().choices[0]
    assert len(pieces) > 2 and "".join(pieces) == whole.message.tool_calls[0].function.arguments
    calls = streamed.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"


def test_tool_results_fed_back(srv: Running) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = post(srv, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    body = chat(srv, messages=messages, tools=[WEATHER], max_tokens=2)
    assert body["usage"]["prompt_tokens"] > 0
    legacy = chat(
        srv, functions=[WEATHER["function"]], function_call={"name": "get_weather"}, seed=2, max_tokens=200
    )
    message = legacy["choices"][0]["message"]
    assert (
        legacy["choices"][0]["finish_reason"] == "function_call"
        and message["function_call"]["name"] == "get_weather"
    )


def test_closing_narrows_to_the_end_of_the_document(engine: LLMEngine) -> None:
    from localllm.structured.closing import Closers, StringState, narrow

    tok = engine.tokenizer
    closers = Closers(tok, engine.args.vocab_size)
    ids = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    state = StringState()
    state.feed(b'{"a": "x\\"y')
    assert state.inside
    allowed = np.ones(engine.args.vocab_size, dtype=bool)
    inside = narrow(allowed, closers, True)
    assert inside[ids[b'"']] and not inside[ids[b"a"]]
    outside = narrow(allowed, closers, False)
    assert outside[ids[b"}"]] and not outside[ids[b'"']] and not outside[ids[b","]]
    allowed[[ids[b"}"], ids[b"]"]]] = False
    assert narrow(allowed, closers, False)[ids[b","]]
    none = np.zeros_like(allowed)
    none[ids[b"a"]] = True
    assert narrow(none, closers, False) is none  # nothing closing allowed: unchanged


def test_tool_calls_with_n_choices(srv: Running) -> None:
    body = chat(srv, tools=[WEATHER], tool_choice="required", n=2, seed=4, max_tokens=200)
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "tool_calls"]
    body = {"model": MODEL_ID, "messages": CHAT, "max_tokens": 200, "stream": True, "n": 2, "seed": 4}
    r = post(srv, "/v1/chat/completions", {**body, "tools": [WEATHER], "tool_choice": "required"})
    finals = [
        c["choices"][0] for c in sse_payloads(r.text) if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert sorted(c["index"] for c in finals) == [0, 1]
    assert all(c["finish_reason"] == "tool_calls" for c in finals)
