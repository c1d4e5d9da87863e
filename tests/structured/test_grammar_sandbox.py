"""Grammars are untrusted programs: bounded before any compile, validated in a child process with a time
and memory budget, compiled on a thread with a large stack. A hostile grammar costs its request a 400,
never the server its life (llguidance overflows an 8 MiB stack on ~3,000 chained rules: SIGSEGV)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import CHAT, Running, engine_factory, error_of, post, running_server

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.errors import InvalidRequestError
from localllm.structured.limits import GrammarLimits
from localllm.structured.matcher import GrammarCompiler
from localllm.structured.spec import StructuredSpec


def chained_lark(n: int) -> str:
    """n rules, each referring to the next: llguidance recurses once per link."""
    rules = [f'r{i}: r{i + 1} "a"' for i in range(n)]
    return "\n".join(["start: r0", *rules, f'r{n}: "b"'])


def chained_refs(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path, index_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1)
    )


def compiler(engine: LLMEngine, **limits: object) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer, engine.args.vocab_size, GrammarLimits(**limits))


def test_chains_past_the_limits_are_refused_before_any_compile(engine: LLMEngine) -> None:
    grammars = compiler(engine)
    with pytest.raises(InvalidRequestError, match="4,002 rules; the limit is 2,000"):
        grammars.compile(StructuredSpec("lark", chained_lark(4000), "guided_grammar"))
    with pytest.raises(InvalidRequestError, match="2,501 \\$refs; the limit is 1,000"):
        grammars.compile(StructuredSpec.json_schema(chained_refs(2500), "response_format"))
    gbnf = "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(2500))
    with pytest.raises(InvalidRequestError, match="2,502 rules"):
        grammars.compile(StructuredSpec("grammar", f'root ::= r0\n{gbnf}\nr2500 ::= "b"'))
    with pytest.raises(InvalidRequestError, match="bytes; the limit is 1,000"):
        compiler(engine, max_bytes=1000).compile(StructuredSpec("regex", "a" * 1001))
    assert grammars.sandbox._idle == []  # nothing was started for them


def test_a_crash_in_the_grammar_library_costs_only_the_request(engine: LLMEngine) -> None:
    """With the bounds lifted and the child's stack at 4 MiB, a 4,000-rule chain kills llguidance in
    the child: the request gets a one-line error, and the next grammar gets a fresh child."""
    grammars = compiler(engine, max_rules=10**6, sandbox_stack=4 << 20)
    with pytest.raises(InvalidRequestError, match="could not compile it .*SIGSEGV"):
        grammars.compile(StructuredSpec("lark", chained_lark(4000), "guided_grammar"))
    assert grammars.compile(StructuredSpec("regex", "[0-9]{3}")) is not None
    grammars.close()


def test_a_slow_compile_is_cut_at_its_time_budget(engine: LLMEngine) -> None:
    """GBNF is converted to Lark in Python (quadratic in the worst case): the budget bounds it."""
    grammar = "root ::= " + " ".join(f"x{i}" for i in range(1500)) + "\n"
    grammar += "\n".join(f'x{i} ::= "{i}" | x{i + 1}' for i in range(1500)) + '\nx1500 ::= "z"'
    grammars = compiler(engine, timeout_s=0.05)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="took longer than 0.05 s, the limit"):
        grammars.compile(StructuredSpec("grammar", grammar, "grammar"))
    assert time.monotonic() - start < 5
    grammars.close()


def test_deep_chains_within_the_limits_compile_off_the_callers_stack(engine: LLMEngine) -> None:
    """2,000 chained rules need ~6 MB of stack to compile: called from a thread with 1 MiB, it still
    works (the compile runs on the compiler's own large-stack thread), and each sequence's matcher is
    a copy of the compiled one."""
    grammars = compiler(engine)
    spec = StructuredSpec("lark", chained_lark(1998), "guided_grammar")
    box: dict = {}

    def compile_and_copy() -> None:
        box["first"] = grammars.matcher(spec)
        box["second"] = grammars.matcher(spec)

    old = threading.stack_size(1 << 20)
    try:
        worker = threading.Thread(target=compile_and_copy)
        worker.start()
    finally:
        threading.stack_size(old)
    worker.join()
    first, second = box["first"], box["second"]
    assert first._matcher is not second._matcher and not first.error
    assert first.allowed().any()
    grammars.close()


# A fuzzer of hostile and ordinary grammars: every one is compiled or refused in one line, in time.
RULE_NAMES = st.sampled_from(["a", "b", "item", "value", "x_1"])
LARK_BITS = st.sampled_from(['"x"', "/[0-9]+/", "(", ")", "|", "*", "+", "?", "a", "b", " ", "\n", ":", "%"])


@st.composite
def hostile_specs(draw: st.DrawFn) -> StructuredSpec:
    kind = draw(st.sampled_from(["chain", "refs", "lark_soup", "gbnf_soup", "regex", "schema"]))
    n = draw(st.integers(1, 3000))
    if kind == "chain":
        return StructuredSpec("lark", chained_lark(n))
    if kind == "refs":
        return StructuredSpec.json_schema(chained_refs(n))
    if kind in ("lark_soup", "gbnf_soup"):
        head = "start: " if kind == "lark_soup" else "root ::= "
        body = "".join(draw(st.lists(LARK_BITS, min_size=1, max_size=200)))
        return StructuredSpec("grammar", head + body)
    if kind == "regex":
        return StructuredSpec(
            "regex", draw(st.text(alphabet="()[]{}|*+?a0-9\\^$.", min_size=1, max_size=300))
        )
    depth = draw(st.integers(1, 120))
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"k": schema, "r": {"$ref": "#"}}}
    return StructuredSpec.json_schema(schema)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=hostile_specs())
def test_fuzzed_grammars_compile_or_are_refused(engine: LLMEngine, spec: StructuredSpec) -> None:
    grammars = engine.grammars
    start = time.monotonic()
    try:
        grammars.compile(spec)
    except InvalidRequestError as e:
        assert "\n" not in str(e).strip() and str(e).startswith(spec.name)
    assert time.monotonic() - start < grammars.limits.timeout_s + 3


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, ctx_size=1024)) as running:
        yield running


def test_hostile_grammars_through_every_endpoint_get_a_400_and_the_server_lives(srv: Running) -> None:
    chain, refs = chained_lark(4000), chained_refs(2500)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": refs}}
    cases = [
        ("/v1/chat/completions", {"messages": CHAT, "guided_grammar": chain}, "guided_grammar"),
        ("/v1/completions", {"prompt": "x", "grammar": chain}, "grammar"),
        ("/v1/chat/completions", {"messages": CHAT, "guided_json": refs}, "guided_json"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": rf}, "response_format"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "guided_choice": [str(i) for i in range(2001)]},
            "guided_choice",
        ),
    ]
    for path, body, param in cases:
        err = error_of(post(srv, path, {**body, "max_tokens": 4}), 400)
        assert err["param"] == param and "limit" in err["message"], err
    anthropic = {
        "messages": CHAT,
        "max_tokens": 4,
        "output_config": {"format": {"type": "json_schema", "schema": refs}},
    }
    assert post(srv, "/v1/messages", anthropic).status_code == 400
    responses = {
        "input": "hi",
        "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": refs}},
    }
    assert post(srv, "/v1/responses", responses).status_code == 400
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    ok = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3


def test_many_distinct_grammars_at_once_are_all_answered(srv: Running) -> None:
    rng = random.Random(0)
    bodies = [
        {"prompt": "x", "max_tokens": 4, "guided_regex": f"[a-z]{{{rng.randint(1, 4)}}}{i}"}
        for i in range(12)
    ]
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda b=b: results.append(post(srv, "/v1/completions", b).status_code))
        for b in bodies
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 12
    assert json.loads(httpx.get(srv.url + "/health", timeout=10).text)
