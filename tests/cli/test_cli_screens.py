"""What a newcomer sees in a terminal: help screens, usage errors and a chat, at 80 and 200 columns
(a real pseudo-terminal through pexpect), and the tables a script sees when the output is piped."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

TIMEOUT = 120  # per expected text: a loaded machine is slow rather than failing
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


def spawn(args: list[str], columns: int, home, **env: str):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "localllm", *args],
        env=dict(
            os.environ,
            LOCALLLM_HOME=str(home),
            PROMPT_TOOLKIT_NO_CPR="1",
            TERM="xterm",
            COLUMNS=str(columns),
            LINES="40",
            **env,
        ),
        encoding="utf-8",
        codec_errors="replace",
        dimensions=(40, columns),
        timeout=TIMEOUT,
    )
    child.logfile_read = io.StringIO()
    return child


def screen(args: list[str], columns: int, home) -> tuple[str, int]:
    """The text a command prints (escape sequences removed) and its exit status."""
    child = spawn(args, columns, home)
    child.expect(pexpect.EOF)
    child.close()
    return ANSI.sub("", child.logfile_read.getvalue()).replace("\r\n", "\n"), child.exitstatus


@pytest.mark.parametrize("columns", [80, 200])
def test_help_reads_cleanly(columns, tmp_path):
    text, status = screen(["run", "--help"], columns, tmp_path)
    assert status == 0
    assert "Usage: localllm run [OPTIONS] [MODEL] PROMPT" in text
    assert not re.search(r"<(bool|str|int|float|list\[str\])>|\{args\}|\[\[MODEL\]\]", text), text
    assert "--no-loop-guard" in text and "--max-tokens" in text
    assert max(len(line) for line in text.splitlines()) <= columns

    text, status = screen(["chat", "--help"], columns, tmp_path)
    assert status == 0 and "Usage: localllm chat [OPTIONS] [MODEL]" in text and "2048" in text

    text, status = screen(["--help"], columns, tmp_path)
    assert status == 0 and "--version" in text and "--install-completion" in text
    assert max(len(line) for line in text.splitlines()) <= columns


@pytest.mark.parametrize("columns", [80, 200])
def test_errors_are_one_line_that_say_what_to_type(columns, tmp_path):
    text, status = screen(["run"], columns, tmp_path)
    assert status == 2 and text.strip().count("\n") == 0, text
    assert text.startswith('error: give a prompt: localllm run "Why is the sky blue?"')

    text, status = screen(["run", "--temprature", "0", "hi"], columns, tmp_path)
    assert status == 2 and text.strip().count("\n") == 0, text
    assert "no such option: --temprature" in text and "localllm run --help" in text and "╭" not in text

    text, status = screen(["--version"], columns, tmp_path)
    assert status == 0 and re.fullmatch(r"localllm \d+\.\d+\.\d+\S*\n", text)


@pytest.mark.parametrize("columns", [80, 200])
def test_chat_screen(columns, tiny_model_path, tmp_path):
    args = ["chat", str(tiny_model_path), "--backend", "numpy", "--temperature", "0", "-n", "8"]
    child = spawn(args, columns, tmp_path / "home")
    child.expect(">>>")
    child.sendline("Hello!")
    child.expect_exact("tok/s")
    child.expect(">>>")
    child.sendline("/set")
    child.expect_exact("loop_guard on")
    child.expect(">>>")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    text = ANSI.sub("", child.logfile_read.getvalue())
    assert child.exitstatus == 0 and "Traceback" not in text, text[-2000:]
    # the default context: the trained one (256 tokens for the tiny model), up to 8192
    assert "localllm chat | model " in text and "context 256 tokens" in text
    assert re.search(r"\d+ tokens \(max 8\), [\d.]+ tok/s \| first token", text), text[-2000:]


def test_tables_when_piped(tmp_path):
    env = dict(os.environ, LOCALLLM_HOME=str(tmp_path / "home"), COLUMNS="80")
    out = subprocess.run(
        [sys.executable, "-m", "localllm", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split("\t")[:6] == ["name", "file", "size", "bytes", "downloaded", "default"]
    assert any(r.startswith("smollm2-135m-instruct\t") and r.split("\t")[5] == "yes" for r in rows)
    out = subprocess.run(
        [sys.executable, "-m", "localllm", "list", "--json"], env=env, capture_output=True, text=True
    )
    models = json.loads(out.stdout)
    assert {m["name"] for m in models} >= {"smollm2-135m-instruct"}
