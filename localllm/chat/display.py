"""How `chat` and `run` draw a reply: streamed plainly or live (Markdown when it looks like Markdown), its
thinking dimmed and set apart, and the one-line stats and notices after it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any, TextIO

from localllm.chat.session import Prompt, TurnStats
from localllm.printable import printable


class ThinkingWriter:
    """A reply's reasoning written as it streams to `out` (`run`: stderr), dimmed on a terminal and set
    apart from the answer that follows by a blank line."""

    def __init__(self, out: Any):
        self.out = out
        self.dim = bool(getattr(out, "isatty", lambda: False)())
        self.open = False

    def write(self, reasoning: str, answer_follows: bool = False) -> None:
        if reasoning:
            if not self.open and self.dim:
                self.out.write("\x1b[2m")
            self.open = True
            self.out.write(reasoning)
            self.out.flush()
        if answer_follows:
            self.close("\n\n")

    def close(self, end: str = "\n") -> None:
        """End the reasoning shown (a reply cut inside it has no answer to follow)."""
        if self.open:
            self.out.write(("\x1b[0m" if self.dim else "") + end)
            self.out.flush()
            self.open = False


class PlainReply:
    """The reply written as it comes (a pipe, a file, or a terminal we do not draw on); its thinking
    goes to `thinking_out` (the same stream unless told otherwise), dimmed on a terminal."""

    def __init__(self, out: TextIO, thinking_out: TextIO | None = None):
        self.out = out
        self.text = ""
        self.thinking = ThinkingWriter(thinking_out or out)

    def __enter__(self) -> PlainReply:
        return self

    def add_thinking(self, text: str) -> None:
        self.thinking.write(text)

    def add(self, text: str) -> None:
        self.thinking.close("\n\n")
        self.text += text
        self.out.write(text)
        self.out.flush()

    def __exit__(self, *exc: Any) -> None:
        self.thinking.close()
        self.out.write("\n")
        self.out.flush()


class _Tail:
    """The last lines of a text that fit on the screen (what a streaming reply shows)."""

    def __init__(self, text: str, style: str = ""):
        self.text = text
        self.style = style

    def __rich_console__(self, console: Any, options: Any) -> Iterable[Any]:
        from rich.segment import Segment
        from rich.text import Text

        text = Text(self.text, style=self.style)
        lines = console.render_lines(text, options.update(height=None), pad=False)
        for line in lines[-max(1, console.height - 2) :]:
            yield from line
            yield Segment.line()


class LiveReply:
    """The reply streamed into a Rich Live region, then drawn whole (as Markdown where it helps)."""

    def __init__(self, console: Any, markdown: bool = True, min_interval: float = 0.05):
        self.console = console
        self.markdown = markdown
        self.min_interval = min_interval
        self.text = ""
        self.thinking = ""  # shown dimmed above the answer
        self._last = 0.0
        self.live: Any = None

    def __enter__(self) -> LiveReply:
        from rich.live import Live

        self.live = Live(
            console=self.console,
            auto_refresh=False,
            vertical_overflow="visible",
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()
        return self

    def add_thinking(self, text: str) -> None:
        self.thinking += text
        self._draw(self.thinking, "dim")

    def add(self, text: str) -> None:
        self.text += text
        self._draw(self.text)

    def _draw(self, text: str, style: str = "") -> None:
        now = time.monotonic()
        if now - self._last >= self.min_interval:
            self._last = now
            self.live.update(_Tail(printable(text, multiline=True), style), refresh=True)

    def __exit__(self, *exc: Any) -> None:
        from rich.console import Group
        from rich.markdown import Markdown
        from rich.text import Text

        shown = printable(self.text, multiline=True)
        final: Any = Markdown(shown) if self.markdown and looks_like_markdown(shown) else Text(shown)
        if self.thinking.strip():
            thought = Text(printable(self.thinking.strip(), multiline=True) + "\n", style="dim")
            final = Group(thought, final)
        self.live.update(final)
        self.live.stop()


def format_stats(stats: TurnStats) -> str:
    """One line per reply, like mlx-lm's: speed, time to first token, context, cache hits."""
    ttft = _seconds(stats.ttft)
    limit = f" (max {stats.max_tokens})" if stats.max_tokens else ""
    line = (
        f"{stats.generated_tokens} tokens{limit}, {stats.decode_tokens_per_s:.1f} tok/s | "
        f"first token {ttft} | "
        f"prompt {stats.prompt_tokens} tokens, {stats.cached_tokens} cached | "
        f"context {stats.context_used}/{stats.context_size}"
    )
    if stats.interrupted:
        line += " | interrupted"
    elif stats.finish_reason == "length":
        full = stats.context_used >= stats.context_size
        line += " | stopped: the context is full" if full else " | stopped at max_tokens (/set max_tokens N)"
    elif stats.finish_reason == "repetition":
        line += " | stopped: the reply kept repeating itself (/set loop_guard off lets it run)"
    return line


def dropped_notice(prompt: Prompt, has_system: bool) -> str:
    turns = "oldest turn" if prompt.dropped_turns == 1 else f"{prompt.dropped_turns} oldest turns"
    kept = "; the system prompt is kept" if has_system else ""
    return (
        f"context full: dropped the {turns} ({plural(prompt.dropped_messages, 'message')}, "
        f"{prompt.dropped_tokens} tokens) to make room{kept}."
    )


_MARKDOWN = re.compile(
    r"(^|\n)\s{0,3}(#{1,6}\s|```|~~~|[-*+]\s|\d+[.)]\s|>\s|\|.*\|)"  # headings, fences, lists, quotes, tables
    r"|\*\*[^*\n]+\*\*|__[^_\n]+__|`[^`\n]+`|\[[^\]\n]+\]\([^)\s]+\)"  # bold, inline code, links
)


def looks_like_markdown(text: str) -> bool:
    return bool(_MARKDOWN.search(text))


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
