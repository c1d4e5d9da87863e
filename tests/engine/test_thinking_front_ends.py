"""Thinking kept apart in the other front ends, on a tiny thinking model with scripted replies: the chat
session records the reasoning apart and gives it to the template, the REPL shows it and `/think off`
switches it off, piped chat writes it to stderr, `run --json` reports it apart, and `LLM.chat`
returns it in `.reasoning`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from tiny_think import reply_ids, script_replies, write_think_model
from typer.testing import CliRunner

from localllm.chat.repl import ChatRepl, answer_once
from localllm.chat.session import ChatSession
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.reasoning import with_reasoning
from localllm.sampling_params import SamplingParams
from localllm.tokenizer.chat_template import require_chat_template

REPLY = "<think>\nThey greet me.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_think_model(tmp_path_factory.mktemp("think") / "think.gguf")


@pytest.fixture(scope="module")
def engine(model: Path, index_dir: Path) -> LLMEngine:
    llm = LLMEngine(EngineConfig(model=str(model), backend="numpy", index_dir=index_dir, threads=1))
    ids = reply_ids(llm, REPLY)
    script_replies(llm, lambda seq: ids)
    return llm


def session_and_params(engine: LLMEngine) -> tuple[ChatSession, SamplingParams]:
    template = require_chat_template(engine.gguf.metadata, "think")
    params = with_reasoning(SamplingParams(temperature=0, max_tokens=64), template, engine.tokenizer)
    return ChatSession(engine.tokenizer, template, engine.max_model_len), params


def test_session_keeps_the_reasoning_apart(engine: LLMEngine) -> None:
    session, params = session_and_params(engine)
    assert params.reasoning is not None
    prompt = session.prepare("hello")
    list(session.respond(engine.stream, prompt, params))
    assert session.messages[-1] == {
        "role": "assistant",
        "content": "Hello there!",
        "reasoning_content": "They greet me.",
    }
    # a later turn: the Qwen3-like template leaves the earlier thinking out (it precedes the last user)
    again = session.prepare("and again")
    assert "They greet me" not in again.text and "Hello there!" in again.text


def test_repl_shows_thinking_and_think_off(engine: LLMEngine) -> None:
    session, params = session_and_params(engine)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    lines = iter(["hello", "/think off", "hello again", "/think", "/exit"])
    repl = ChatRepl(session, engine.stream, params, console, lambda prompt: next(lines), live=False)
    repl.run()
    text = out.getvalue()
    assert "They greet me." in text and "Hello there!" in text and "thinking off" in text
    assert repl.params.reasoning is not None and repl.params.reasoning.budget == 0
    assert session.template_kwargs == {"enable_thinking": False}
    # with thinking off the template wrote an empty block, and the budget closed the scripted one at once
    assert "<think>\n\n</think>" in session.last_prompt.text  # type: ignore[union-attr]
    assert "reasoning_content" not in session.messages[-1]


def test_piped_chat_writes_thinking_to_stderr(engine: LLMEngine) -> None:
    session, params = session_and_params(engine)
    out, err = io.StringIO(), io.StringIO()
    answer_once(session, engine.stream, params, "hello", out, err)
    assert out.getvalue() == "Hello there!\n"
    assert err.getvalue().startswith("They greet me.\n")


def test_run_json_reports_reasoning_apart(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import localllm.engine.engine as engine_module
    from localllm.cli import run  # noqa: F401  (registers the command)
    from localllm.cli.app import app

    class Scripted(LLMEngine):
        def __init__(self, config: EngineConfig):
            super().__init__(config)
            ids = reply_ids(self, REPLY)
            script_replies(self, lambda seq: ids)

    monkeypatch.setattr(engine_module, "LLMEngine", Scripted)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    args = ["run", str(model), "hello", "--backend", "numpy", "--temperature", "0", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["text"], report["reasoning"]) == ("Hello there!", "They greet me.")
    assert report["reasoning_tokens"] == len(reply_ids_of(model, "\nThey greet me.\n"))
    budget = CliRunner().invoke(app, [*args, "--reasoning-budget", "2"])
    assert json.loads(budget.stdout.strip().splitlines()[-1])["reasoning_tokens"] == 2
    plain = CliRunner().invoke(app, args[:-1])  # streamed: the answer alone on stdout
    assert plain.exit_code == 0 and plain.stdout.strip() == "Hello there!"


def reply_ids_of(model: Path, text: str) -> list[int]:
    from localllm.loading.file import GGUFFile
    from localllm.tokenizer import load_tokenizer

    return load_tokenizer(GGUFFile.open(model).metadata).encode(text, add_special=False)


def test_python_api_chat_returns_reasoning(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm import LLM

    monkeypatch.setenv("LOCALLLM_HOME", str(model.parent / "home"))
    llm = LLM(str(model), backend="numpy", threads=1)
    ids = reply_ids(llm.engine, REPLY)
    script_replies(llm.engine, lambda seq: ids)
    out = llm.chat([{"role": "user", "content": "hello"}], {"temperature": 0})
    assert (out.reasoning, out.text) == ("They greet me.", "Hello there!")
    budget = llm.chat([{"role": "user", "content": "hello"}], {"temperature": 0}, reasoning_budget=1)
    assert budget.reasoning_tokens == 1 and budget.text
    off = llm.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert len(off) > len(llm.apply_chat_template([{"role": "user", "content": "hi"}]))
