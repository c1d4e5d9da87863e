"""`localllm chat` as a person uses it: a real pseudo-terminal (pexpect), typed turns, slash commands,
a multi-line block, Esc+Enter, Ctrl-C during a reply, Ctrl-D to leave.

The tiny model writes random tokens, so these tests check the structure of the transcript (replies
and stats lines appear, commands answer, nothing crashes), never the content of the replies.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"  # prompt_toolkit draws ">>> " with a cursor move in place of the space
TIMEOUT = 120  # per expected text: generous, so a loaded machine is slow rather than failing
# A reply with no max_tokens runs until the context is full (the tiny model's greedy replies have no
# end-of-text). With 8k tokens it ran 3-17 s and wrote only ~16 KB (the live view redraws its tail),
# which the terminal buffers without the test reading: a test process descheduled that long missed
# the whole reply. 128k tokens take many times longer, and write more than a terminal buffers, so
# the reply cannot end unless the test reads, and it is still streaming when Ctrl-C arrives.
LONG_CONTEXT = "131072"


def spawn(model, home, *args):
    env = dict(
        os.environ,
        LOCALLLM_HOME=str(home),
        PROMPT_TOOLKIT_NO_CPR="1",
        TERM="xterm",
        COLUMNS="100",
        LINES="30",
    )
    command = ["-m", "localllm", "chat", str(model), "--backend", "numpy", "--temperature", "0", *args]
    child = pexpect.spawn(
        sys.executable,
        command,
        env=env,
        encoding="utf-8",
        codec_errors="replace",
        dimensions=(30, 100),
        timeout=TIMEOUT,
        # A test run started in the background of a shell inherits SIGINT ignored, and so would the
        # chat: Ctrl-C would then never reach it. A user's terminal delivers it; so does this.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.logfile_read = io.StringIO()
    child.expect(PROMPT)
    return child


def say(child, line, *expected):
    """Type a line, wait for each expected text in turn, then for the next prompt."""
    child.sendline(line)
    for text in expected:
        child.expect_exact(text)
    child.expect(PROMPT)


def leave(child) -> str:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    transcript = child.logfile_read.getvalue()
    assert child.exitstatus == 0, transcript[-2000:]
    assert "Traceback" not in transcript
    return transcript


# The prompt hands a line over (bracketed paste off), then, past any escape sequences, the first
# character of the reply appears.
REPLY_STARTED = r"\x1b\[\?2004l(?:\x1b\[[0-9;?]*[A-Za-z]|[\r\n])*[^\x1b\r\n]"


def interrupt_a_reply(child) -> None:
    """Ask for a reply that cannot end on its own for a long while, wait until its text is on the
    screen (so the chat is inside the streaming loop, where Ctrl-C stops the reply), then press Ctrl-C.
    Nothing here depends on timing: each step waits for what the terminal shows."""
    say(child, "/set temperature 0", "temperature = 0")  # greedy: no end-of-text sampled by chance
    say(child, "/set loop_guard off", "loop_guard = off")  # the tiny model's greedy reply soon loops
    child.sendline("Tell me a very long story.")
    child.expect(REPLY_STARTED)
    child.sendintr()
    ended = child.expect(["interrupted", r"stopped: the context is full", r"stopped at max_tokens"])
    assert ended == 0, "the reply ended before Ctrl-C: " + child.logfile_read.getvalue()[-2000:]


def test_chat_session_in_a_terminal(tiny_model_path, tmp_path):
    home = tmp_path / "home"
    saved = tmp_path / "conversation.json"
    child = spawn(tiny_model_path, home, "-n", "16", "--ctx-size", LONG_CONTEXT)
    say(child, "Hello, who are you?", "tok/s", "context")
    say(child, "/help", "/regen", "Ctrl-C")
    say(child, "/set temperature 0.5", "temperature = 0.5")
    # a multi-line block between triple quotes is one message
    child.sendline('"""')
    child.sendline("first line of a block")
    say(child, 'last line"""', "tok/s")
    # Esc+Enter (what Alt+Enter sends) puts a newline inside the message
    child.send("alpha")
    child.send("\x1b\r")
    say(child, "beta", "tok/s")
    say(child, "/system You answer in French.", "system prompt set")
    say(child, "/stats", "prompt tokens:", "cache")
    say(child, f"/save {saved}", "saved 7 messages")
    say(child, "/clear", "conversation cleared")
    say(child, f"/load {saved}", "loaded 7 messages")
    say(child, "/regen", "tok/s")
    # a long reply, stopped with Ctrl-C while it is being written: the chat goes on
    say(child, "/set max_tokens -1", "max_tokens = none")
    interrupt_a_reply(child)
    child.expect(PROMPT)
    child.sendintr()  # Ctrl-C at the prompt only clears the line
    child.expect(PROMPT)
    say(child, "/set max_tokens 8", "max_tokens = 8")
    say(child, "And now?", "tok/s")
    transcript = leave(child)

    assert transcript.count("tok/s") >= 6
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert messages[0]["content"] == "You answer in French."
    assert messages[3]["content"] == "first line of a block\nlast line"
    assert messages[5]["content"] == "alpha\nbeta"
    history = (home / "chat_history").read_text()
    assert "Hello, who are you?" in history and "/set temperature 0.5" in history


def test_small_context_drops_oldest_turns_and_says_so(tiny_model_path, tmp_path):
    child = spawn(tiny_model_path, tmp_path / "home", "-n", "16", "--ctx-size", "80", "--system", "Be terse.")
    for i in range(3):
        child.sendline(f"message number {i} with a few more words in it")
        index = child.expect([r"context full: dropped the (\d+ )?oldest turn", "tok/s"])
        if index == 0:
            break
        child.expect(PROMPT)
    else:
        pytest.fail("no turn was dropped: " + child.logfile_read.getvalue()[-2000:])
    child.expect_exact("the system prompt is kept")
    child.expect("tok/s")
    child.expect(PROMPT)
    say(child, "/stats", "context")
    leave(child)
