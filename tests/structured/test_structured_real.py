"""Structured output and tool calls on real models, through the official openai client: a few of the
20 Pydantic models of tests/fixtures/structured_parse.py (the full run is that script), and forced
tool calls on Qwen2.5-Coder-0.5B valid for their schema (tests/fixtures/tool_calls_auto.py has 20)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import FIXTURES
from server_harness import Running, engine_factory, running_server

sys.path.insert(0, str(FIXTURES))
import structured_parse  # noqa: E402
import tool_calls_auto  # noqa: E402

pytestmark = pytest.mark.slow
SUBSET = [structured_parse.CASES[i] for i in (1, 5)]  # a nested object; a list of objects with enums


@pytest.fixture(scope="module")
def qwen(qwen25c_path: Path, model_index_dir: Path) -> Iterator[Running]:
    factory = engine_factory(qwen25c_path, model_index_dir, backend="numba", ctx_size=2048, max_num_seqs=4)
    with running_server(factory, model_id="qwen") as running:
        yield running


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path, model_index_dir: Path) -> Iterator[Running]:
    factory = engine_factory(smollm2_path, model_index_dir, backend="numba", ctx_size=2048, max_num_seqs=4)
    with running_server(factory, model_id="smollm2") as running:
        yield running


@pytest.mark.parametrize("server", ["smollm2", "qwen"])
def test_openai_parse_is_schema_valid(server: str, request: pytest.FixtureRequest) -> None:
    srv: Running = request.getfixturevalue(server)
    errors = structured_parse.run(srv.url + "/v1", 256, SUBSET)
    assert errors == [""] * len(SUBSET)


def test_forced_tool_calls_valid_on_qwen(qwen: Running) -> None:
    client = qwen.client()
    by_name = {t["function"]["name"]: t for t in tool_calls_auto.TOOLS}
    for prompt, want in tool_calls_auto.PROMPTS[::10]:
        for choice in ("required", {"type": "function", "function": {"name": want}}):
            reply = tool_calls_auto.ask(client, "qwen", prompt, choice)
            call = reply.message.tool_calls[0].function
            assert reply.finish_reason == "tool_calls"
            assert tool_calls_auto.valid_args(by_name[call.name], call.arguments), call
