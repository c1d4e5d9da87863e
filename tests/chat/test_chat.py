"""`localllm chat` below the terminal: the session (KV reuse across turns, trimming, save/load), the
REPL driven by scripted input, piped use, and the refusal of a model without a chat template."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from localllm.chat.display import format_stats, looks_like_markdown
from localllm.chat.repl import ChatRepl, printable, read_message
from localllm.chat.session import ChatSession
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.errors import ContextLengthExceededError, LocalLLMError
from localllm.sampling_params import SamplingParams
from localllm.tokenizer.chat_template import require_chat_template, template_text

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_path, index_dir):
    config = EngineConfig(
        model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1, max_num_seqs=1
    )
    return LLMEngine(config)


def new_session(engine, system=None, max_model_len=None) -> ChatSession:
    template = require_chat_template(engine.gguf.metadata, "tiny")
    return ChatSession(engine.tokenizer, template, max_model_len or engine.max_model_len, system)


def reply(session, engine, text, params=PARAMS):
    prompt = session.prepare(text, params.max_tokens)
    outs = list(session.respond(engine.stream, prompt, params))
    return prompt, outs


def cli_env(tmp_path) -> dict[str, str]:
    return dict(os.environ, LOCALLLM_HOME=str(tmp_path / "home"), COLUMNS="120")


# ---------------------------------------------------------------- session


def test_turn_two_prefills_only_the_new_tokens(engine):
    session = new_session(engine, system="You are terse.")
    first, _ = reply(session, engine, "Hello there, how are you?")
    turn1 = session.history[-1]
    history_len = turn1.context_used  # the first prompt and its reply
    assert turn1.generated_tokens == 16 and turn1.context_used == len(first.ids) + 16

    second, _ = reply(session, engine, "And the second question?")
    turn2 = session.history[-1]
    assert second.ids[: len(first.ids)] == first.ids  # the new prompt starts with the old one
    block = engine.config.block_size
    # every full KV block of turn 1 (its prompt and reply, the last sampled token excepted) is reused
    assert turn2.cached_tokens >= (history_len - 1) // block * block
    assert turn2.cached_tokens >= len(first.ids)
    new_tokens = turn2.prompt_tokens - history_len
    assert turn2.prompt_tokens - turn2.cached_tokens < new_tokens + block
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_regen_reuses_the_prompt_and_replaces_the_reply(engine):
    session = new_session(engine)
    first, _ = reply(session, engine, "Say something.")
    prompt = session.prepare_regen(PARAMS.max_tokens)
    assert prompt.ids == first.ids
    list(session.respond(engine.stream, prompt, PARAMS))
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.history[-1].cached_tokens >= len(first.ids) // 16 * 16
    with pytest.raises(LocalLLMError, match="no reply to regenerate"):
        new_session(engine).prepare_regen()


def test_overflow_drops_oldest_turns_and_keeps_the_system_prompt(engine):
    session = new_session(engine, system="You are a terse assistant.", max_model_len=100)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dropped = []
    for i in range(6):
        prompt, _ = reply(session, engine, f"question number {i}: tell me about the sea", params)
        assert len(prompt.ids) + session.reserve_tokens(8) <= 100
        dropped.append(prompt.dropped_turns)
        assert session.messages[0] == {"role": "system", "content": "You are a terse assistant."}
        assert session.messages[-2]["content"].startswith(f"question number {i}")
    assert sum(dropped) > 0 and dropped[0] == 0
    assert session.messages[1]["role"] == "user"  # whole turns go, so user/assistant still alternate
    assert "question number 0" not in json.dumps(session.messages)


def test_a_message_too_long_for_the_context_is_refused_and_forgotten(engine):
    session = new_session(engine, system="sys", max_model_len=64)
    reply(session, engine, "hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    before = [dict(m) for m in session.messages]
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 64 tokens"):
        session.prepare("word " * 200)
    assert session.messages == before


def test_interrupted_reply_is_kept_and_marked(engine):
    session = new_session(engine)
    prompt = session.prepare("go")
    stream = session.respond(engine.stream, prompt, SamplingParams(temperature=0, max_tokens=200))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # what Ctrl-C does: the request is aborted, the partial reply kept
    assert session.messages[-1]["role"] == "assistant" and session.messages[-1]["interrupted"] is True
    assert session.history[-1].interrupted and "interrupted" in format_stats(session.history[-1])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_save_and_load(engine, tmp_path):
    session = new_session(engine, system="Be kind.")
    reply(session, engine, "line one\nline two")
    path = session.save(tmp_path / "chat.json")
    data = json.loads(path.read_text())
    assert data["format"] == "localllm-chat" and len(data["messages"]) == 3

    other = new_session(engine)
    assert other.load(path) == 3 and other.messages == session.messages and other.system == "Be kind."
    prompt = other.prepare("next")
    assert prompt.ids[: len(session.last_prompt.ids)] == session.last_prompt.ids  # same tokens either way

    (tmp_path / "bad.json").write_text('[{"role": "robot", "content": "x"}]')
    with pytest.raises(LocalLLMError, match="needs a role"):
        other.load(tmp_path / "bad.json")
    with pytest.raises(LocalLLMError, match="cannot read"):
        other.load(tmp_path / "missing.json")


# ---------------------------------------------------------------- the REPL, scripted


def scripted(lines):
    it = iter(lines)

    def read(prompt):
        try:
            item = next(it)
        except StopIteration:
            raise EOFError from None
        if isinstance(item, BaseException):
            raise item
        return item

    return read


def test_read_message_blocks():
    assert read_message(scripted(["plain"])) == "plain"
    assert read_message(scripted(['"""', "a", "b", '"""'])) == "a\nb"
    assert read_message(scripted(['"""first', 'second"""'])) == "first\nsecond"
    assert read_message(scripted(['"""one line"""'])) == "one line"


def test_repl_commands_and_overflow_notice(engine, tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    session = new_session(engine, system="You are terse.", max_model_len=90)
    save = tmp_path / "c.json"
    lines = [
        "/help",
        "first message about cats",
        "/set temperature 0.5",
        "/set top_k 7",
        "/set max_tokens 12",
        "/set bogus 1",
        "/set temperature -1",
        "second message about dogs",
        KeyboardInterrupt(),
        '"""',
        "third message",
        "on two lines",
        '"""',
        "/stats",
        f"/save {save}",
        "/clear",
        f"/load {save}",
        "/regen",
        "/system Be brief.",
        "/system",
        "/nope",
        "//etc/hosts is a file",
        "/exit",
        "never read",
    ]
    repl = ChatRepl(session, engine.stream, PARAMS, console, scripted(lines), {"model": "tiny"})
    repl.run()
    text = out.getvalue()
    assert "Traceback" not in text
    assert "/regen" in text and "Esc Enter" in text  # the help
    assert text.count("tok/s") >= 5  # four replies and /stats
    assert repl.params.temperature == 0.5 and repl.params.top_k == 7 and repl.params.max_tokens == 12
    assert "cannot set 'bogus'" in text and "temperature must be >= 0" in text
    assert "context full: dropped the" in text and "the system prompt is kept" in text
    assert "saved" in text and "loaded" in text and "unknown command /nope" in text
    assert "system prompt: Be brief." in text
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert session.messages[-2] == {"role": "user", "content": "/etc/hosts is a file"}
    assert any(
        m["content"] == "third message\non two lines" for m in json.loads(save.read_text())["messages"]
    )


def test_markdown_detection_and_printable():
    assert looks_like_markdown("# Title\n\ntext") and looks_like_markdown("use `x` here")
    assert looks_like_markdown("1. one\n2. two") and looks_like_markdown("```py\nx\n```")
    assert not looks_like_markdown("Just a sentence, nothing more.")
    assert printable("a\x1b[2Jb\n\tc\x7f\x9b\u202e", multiline=True) == "a\\x1b[2Jb\n\tc\\x7f\\x9b\\u202e"


# ---------------------------------------------------------------- the command, not on a terminal


def test_piped_question_is_answered(tiny_model_path, tmp_path):
    # Greedy: a sampled reply from the random model may draw its end token early (CI saw 22 of 24).
    cmd = [
        sys.executable,
        "-m",
        "localllm",
        "chat",
        str(tiny_model_path),
        "--backend",
        "numpy",
        "-n",
        "24",
        "--temp",
        "0",
    ]
    result = subprocess.run(
        cmd, input="What is the sea?\n", capture_output=True, text=True, env=cli_env(tmp_path), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "24 tokens (max 24)" in result.stderr and "tok/s" in result.stderr and "context" in result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr


def test_model_without_template_is_refused_unless_one_is_given(tmp_path, monkeypatch):
    import gguf
    from tiny_model import write_tiny_model

    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, value: None)
    base = write_tiny_model(tmp_path / "base.Q8_0.gguf")
    cmd = [sys.executable, "-m", "localllm", "chat", str(base), "--backend", "numpy", "-n", "4"]
    env = cli_env(tmp_path)
    refused = subprocess.run(cmd, input="hi", capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "has no chat template" in refused.stderr
    assert "--chat-template" in refused.stderr
    ok = subprocess.run(
        [*cmd, "--chat-template", "chatml"], input="hi", capture_output=True, text=True, env=env, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    with pytest.raises(LocalLLMError, match="cannot read the chat template file"):
        template_text(str(tmp_path / "nope.jinja"))
    assert "<|im_start|>" in template_text("chatml") and template_text("{{ x }}") == "{{ x }}"


def test_live_reply_ends_as_markdown_on_a_terminal():
    from localllm.chat.display import LiveReply

    out = io.StringIO()
    console = Console(file=out, width=60, height=20, force_terminal=True, color_system=None)
    with LiveReply(console, min_interval=0) as live:
        for piece in ["# Title\n\n", "Some **bold", "** text.\n"]:
            live.add(piece)
    final = out.getvalue().rsplit("Some", 1)
    assert "bold text." in final[1] and "**" not in final[1]  # the last drawing is the rendered Markdown
