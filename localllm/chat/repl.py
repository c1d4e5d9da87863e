"""The terminal side of `localllm chat`: reading input, slash commands, drawing replies and stats.

Input comes from prompt_toolkit when stdin and stdout are terminals (line editing, history saved
across sessions, Esc+Enter / Alt+Enter for a new line), else from plain `input()`. A line that starts
with three double quotes opens a multi-line block that ends at a line ending with them.

Replies stream live. On a terminal the text is drawn through a Rich Live region showing the tail
that fits the screen; when the reply is done it is redrawn whole, as Markdown if it looks like
Markdown. Elsewhere (a pipe, a file) the text is written as it comes, unchanged.

Ctrl-C while a reply streams stops it (the request is aborted and its KV blocks freed); the partial
reply stays in the conversation, marked interrupted (see session.py). Ctrl-C at the prompt clears
the line; Ctrl-D or /exit leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from localllm.chat.display import (
    LiveReply,
    PlainReply,
    dropped_notice,
    format_stats,
    plural,
)
from localllm.chat.session import ChatSession, Prompt, StreamFn, TurnStats
from localllm.errors import LocalLLMError
from localllm.printable import printable
from localllm.sampling_params import SamplingParams

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'
Reader = Callable[[str], str]  # returns a line; raises EOFError (Ctrl-D) or KeyboardInterrupt (Ctrl-C)

COMMANDS = [
    ("/help", "show this help"),
    ("/exit", "leave (also /quit, /bye or Ctrl-D)"),
    ("/clear", "forget the conversation; the system prompt stays"),
    ("/system [TEXT]", "show the system prompt, or set it to TEXT"),
    (
        "/set [PARAM VALUE]",
        "show the sampling settings, or change one: "
        + ", ".join(["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repeat_penalty"])
        + ", loop_guard (on/off)",
    ),
    ("/stats", "context use, cache hits and speed so far"),
    ("/save FILE", "save the conversation as JSON"),
    ("/load FILE", "replace the conversation with one saved by /save"),
    ("/regen", "answer the last message again (replaces the last reply)"),
    ("/think [on|off]", "a thinking model: let it think (shown dimmed) or answer at once"),
    ("//TEXT", "send a message that starts with a slash"),
]
KEYS = [
    ("Enter", "send"),
    ("Esc Enter / Alt+Enter", "new line inside a message"),
    ('"""', 'start a multi-line block; a line ending with """ sends it'),
    ("Up / Down", "input history (kept across sessions)"),
    ("Ctrl-C", "stop the reply being written (it is kept, marked interrupted)"),
    ("Ctrl-D", "leave"),
]

# name -> (SamplingParams field, parser); "none"/"-1" mean "no limit"/"random" where that applies
_NONE = {"none", "off", "random", "-1"}


def _opt_int(value: str) -> int | None:
    return None if value.lower() in _NONE else int(value)


def _on_off(value: str) -> bool:
    word = value.lower()
    if word not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
        raise ValueError(value)
    return word in ("on", "true", "1", "yes")


SETTABLE: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temperature": ("temperature", float),
    "temp": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "max_tokens": ("max_tokens", _opt_int),
    "n": ("max_tokens", _opt_int),
    "seed": ("seed", _opt_int),
    "repeat_penalty": ("repeat_penalty", float),
    "loop_guard": ("loop_guard", _on_off),
}
SHOWN = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repeat_penalty", "loop_guard")


class Quit(Exception):
    """Raised by /exit."""


# ---------------------------------------------------------------------------------------- input


def prompt_toolkit_reader(history_file: Path | None) -> Reader:
    """Line editing with history across sessions; Esc+Enter (Alt+Enter) inserts a newline."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    history: Any = InMemoryHistory()
    if history_file is not None:
        try:
            history_file.parent.mkdir(parents=True, exist_ok=True)
            history_file.touch(exist_ok=True)
            history = FileHistory(str(history_file))
        except OSError:  # a read-only home only costs the history
            pass
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    session: Any = PromptSession(history=history, key_bindings=bindings, multiline=False)

    def read(prompt: str) -> str:
        return session.prompt(prompt, prompt_continuation=lambda width, *_: "." * (width - 1) + " ")

    return read


def plain_reader(prompt: str) -> str:
    return input(prompt)


def read_message(read: Reader) -> str:
    """One message: a line, or a block between lines that start / end with three double quotes."""
    line = read(PROMPT)
    stripped = line.strip()
    if not stripped.startswith(FENCE):
        return line
    body = stripped[len(FENCE) :]
    if len(body) >= len(FENCE) and body.endswith(FENCE):
        return body[: -len(FENCE)].strip()
    lines = [body] if body else []
    while True:
        line = read(CONTINUATION)
        if line.rstrip().endswith(FENCE):
            lines.append(line.rstrip()[: -len(FENCE)])
            break
        lines.append(line)
    return "\n".join(lines).strip("\n")


# ---------------------------------------------------------------------------------------- output


# ---------------------------------------------------------------------------------------- the loop


class ChatRepl:
    """The interactive loop. `read` gives lines; `console` (Rich) gets replies, notices and stats."""

    def __init__(
        self,
        session: ChatSession,
        stream: StreamFn,
        params: SamplingParams,
        console: Any,
        read: Reader,
        about: dict[str, Any] | None = None,
        live: bool | None = None,
    ):
        self.session = session
        self.stream = stream
        self.params = params
        self.console = console
        self.read = read
        self.about = about or {}
        self.live = console.is_terminal if live is None else live
        self.show_thinking = True
        self._budget = params.reasoning.budget if params.reasoning is not None else None

    # -- output helpers
    def say(self, text: str, style: str = "dim") -> None:
        from rich.text import Text

        shown = Text(printable(text, multiline=True), style=style)  # may quote a file's or the model's text
        self.console.print(shown, soft_wrap=True)  # the terminal wraps; no hard breaks

    def error(self, message: str) -> None:
        self.say(f"error: {message}", "bold red")

    def banner(self) -> None:
        facts = " | ".join(f"{k} {v}" for k, v in self.about.items())
        self.say(f"localllm chat | {facts}" if facts else "localllm chat")
        self.say('/help for commands, """ for multi-line input, Ctrl-C stops a reply, Ctrl-D leaves.')

    # -- main loop
    def run(self) -> None:
        self.banner()
        while True:
            try:
                text = read_message(self.read)
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt drops the line
            except EOFError:
                break
            try:
                if text.strip().startswith("//"):  # a message that starts with a slash
                    self.turn(self.session.prepare(text.strip()[1:], self.params.max_tokens))
                elif text.strip().startswith("/"):
                    self.command(text.strip())
                elif text.strip():
                    self.turn(self.session.prepare(text, self.params.max_tokens))
            except Quit:
                break
            except LocalLLMError as e:
                self.error(str(e))

    def turn(self, prompt: Prompt) -> TurnStats | None:
        """Stream one reply to `prompt`, then print its stats line."""
        if prompt.dropped_turns:
            self.say(dropped_notice(prompt, self.session.system is not None), "yellow")
        reply = self.session.respond(self.stream, prompt, self.params)
        renderer: Any = LiveReply(self.console) if self.live else PlainReply(self.console.file)
        try:
            with renderer:
                for out in reply:
                    if out.reasoning and self.show_thinking:
                        renderer.add_thinking(out.reasoning)
                    if out.text:
                        renderer.add(out.text)
        except KeyboardInterrupt:
            pass
        finally:
            reply.close()  # aborts the request if it is still running; the reply joins the history
        if not self.session.history:
            return None
        stats = self.session.history[-1]
        self.say(format_stats(stats))
        if stats.interrupted:
            self.say("interrupted: the partial reply is kept (/regen answers again).", "yellow")
        return stats

    # -- slash commands
    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        handler = {
            "/help": self.cmd_help,
            "/?": self.cmd_help,
            "/exit": self.cmd_exit,
            "/quit": self.cmd_exit,
            "/bye": self.cmd_exit,
            "/clear": self.cmd_clear,
            "/system": self.cmd_system,
            "/set": self.cmd_set,
            "/stats": self.cmd_stats,
            "/save": self.cmd_save,
            "/load": self.cmd_load,
            "/regen": self.cmd_regen,
            "/think": self.cmd_think,
        }.get(name.lower())
        if handler is None:
            raise LocalLLMError(f"unknown command {name}; /help lists the commands.")
        handler(arg)

    def cmd_help(self, arg: str) -> None:
        from rich.table import Table

        table = Table(box=None, show_header=False, padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, text in COMMANDS:
            table.add_row(key, text)
        table.add_row("", "")
        for key, text in KEYS:
            table.add_row(key, text)
        self.console.print(table)

    def cmd_exit(self, arg: str) -> None:
        raise Quit

    def cmd_clear(self, arg: str) -> None:
        self.session.clear()
        kept = " (the system prompt stays)" if self.session.system else ""
        self.say(f"conversation cleared{kept}.")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.say(f"system prompt: {self.session.system}" if self.session.system else "no system prompt.")
            return
        self.session.set_system(arg)
        self.say("system prompt set; it applies from the next reply.")

    def cmd_set(self, arg: str) -> None:
        if not arg:
            self.say(", ".join(f"{k} {_show(getattr(self.params, k))}" for k in SHOWN))
            return
        key, _, value = arg.partition(" ")
        key, value = key.lower().replace("-", "_"), value.strip()
        if key not in SETTABLE:
            raise LocalLLMError(f"cannot set {key!r}; choose one of: {', '.join(SHOWN)}.")
        if not value:
            raise LocalLLMError(f"/set {key} needs a value, e.g. /set {key} {_example(key)}.")
        field, parse = SETTABLE[key]
        try:
            parsed = parse(value)
        except ValueError:
            raise LocalLLMError(f"{value!r} is not a valid value for {field}.") from None
        self.params = dataclasses.replace(self.params, **{field: parsed})  # validates
        self.say(f"{field} = {_show(parsed)}")

    def cmd_stats(self, arg: str) -> None:
        session, history = self.session, self.session.history
        lines = [f"{k}: {v}" for k, v in self.about.items()]
        lines.append(
            f"conversation: {plural(session.turns, 'turn')}, {plural(len(session.messages), 'message')}; "
            f"context {session.context_used}/{session.max_model_len} tokens"
        )
        if history:
            prompt = sum(s.prompt_tokens for s in history)
            cached = sum(s.cached_tokens for s in history)
            generated = sum(s.generated_tokens for s in history)
            decode_time = sum(s.elapsed - (s.ttft or 0) for s in history if s.ttft is not None)
            lines.append(
                f"replies: {len(history)}, {generated} tokens generated"
                + (f", {generated / decode_time:.1f} tok/s overall" if decode_time > 0 else "")
            )
            lines.append(
                f"prompt tokens: {prompt}, of which {cached} came from the cache ({_pct(cached, prompt)})"
            )
            lines.append(f"last reply: {format_stats(history[-1])}")
        else:
            lines.append("no replies yet.")
        lines.append("sampling: " + ", ".join(f"{k} {_show(getattr(self.params, k))}" for k in SHOWN))
        for line in lines:
            self.say(line, "")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise LocalLLMError("/save needs a file name, e.g. /save chat.json.")
        path = self.session.save(arg)
        self.say(f"saved {plural(len(self.session.messages), 'message')} to {path}.")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise LocalLLMError("/load needs a file name, e.g. /load chat.json.")
        count = self.session.load(arg)
        turns = plural(self.session.turns, "turn")
        self.say(f"loaded {plural(count, 'message')} from {Path(arg).expanduser()} ({turns}).")

    def cmd_regen(self, arg: str) -> None:
        self.turn(self.session.prepare_regen(self.params.max_tokens))

    def cmd_think(self, arg: str) -> None:
        """/think off: the template's thinking switch off (Qwen3's enable_thinking) and a budget of 0,
        which closes any block the model opens at once; /think on: back to the model's own way."""
        spec = self.params.reasoning
        if spec is None:
            raise LocalLLMError("this model does not think apart (its chat template has no thinking format).")
        if not arg:
            self.say(f"thinking is {'on' if self.show_thinking else 'off'}.")
            return
        try:
            on = _on_off(arg)
        except ValueError:
            raise LocalLLMError("/think takes on or off.") from None
        self.show_thinking = on
        self.params = dataclasses.replace(self.params, reasoning=spec.with_budget(self._budget if on else 0))
        self.session.template_kwargs = {} if on else {"enable_thinking": False}
        self.say(f"thinking {'on' if on else 'off'}; it applies from the next reply.")


def answer_once(
    session: ChatSession, stream: StreamFn, params: SamplingParams, text: str, out: TextIO, err: TextIO
) -> TurnStats:
    """Non-interactive chat: one message in, the reply written plainly to `out`, stats to `err`."""
    if not text.strip():
        raise LocalLLMError("there is nothing to answer: the input is empty.")
    prompt = session.prepare(text, params.max_tokens)
    if prompt.dropped_turns:
        print(dropped_notice(prompt, session.system is not None), file=err)
    with PlainReply(out, err) as renderer:  # the thinking to stderr, the answer to stdout
        for output in session.respond(stream, prompt, params):
            if output.reasoning:
                renderer.add_thinking(output.reasoning)
            if output.text:
                renderer.add(output.text)
    stats = session.history[-1]
    print(format_stats(stats), file=err)
    return stats


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _example(key: str) -> str:
    examples = {"seed": "42", "max_tokens": "512", "top_k": "40", "loop_guard": "off"}
    return examples.get(SETTABLE[key][0], "0.7")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"
