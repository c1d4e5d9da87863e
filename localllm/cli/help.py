"""Help screens and usage errors that read like the tools people know (git, llama.cpp, ollama).

Typer prints each parameter's Python type beside it (`<bool>`, `<str>`, `<list[str]>`), writes a
required argument as `{args}...` and an optional one with a metavar as `[[MODEL]]` in the usage line,
and boxes a usage error into a panel.  Here a flag shows no type, a value shows click's word for it
(TEXT, INTEGER, FLOAT) or its metavar, a metavar is printed as written, and an error is one line that
says what to type.
"""

from __future__ import annotations

import sys
from typing import Any

from typer import core

from localllm.printable import printable


class UsageProblem(Exception):
    """A command line that cannot work, in words that say what to type instead (exit status 2)."""


# Typer's own word for an option's value; the method exists in some Typer versions only (0.12-0.26 and
# 0.28+ have it, 0.27 does not), so every patch below is applied only where its target exists.
_TYPER_OPTION_WORD = getattr(core.TyperOption, "display_type_rich", None)
# Typer's type labels -> click's words for them.
_WORDS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "Path": "PATH"}


def _value_word(self: Any, ctx: Any) -> str | None:
    if getattr(self, "is_flag", False) or getattr(self, "count", False):
        return None
    if self.metavar is not None:
        return self.metavar
    if _TYPER_OPTION_WORD is None:
        return None
    word = _TYPER_OPTION_WORD(self, ctx)  # "<int>", "<list[str]>", "<numba|numpy>" (older Typer: "INTEGER")
    if not word:
        return None
    word = word.strip("<>.").removeprefix("list[").removesuffix("]")
    return _WORDS.get(word, word)


def _argument_word(self: Any, ctx: Any) -> None:
    return None  # the argument's name column already says it


def _usage_name(self: Any) -> str:
    if self.metavar is not None:
        return self.metavar
    name = self.name.upper()
    name = name if self.required else f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


def install() -> None:
    """Patch Typer's parameter classes where the installed version has what is patched; elsewhere its
    own help stands (a help screen worded differently, never a crash)."""
    patches = (
        (core.TyperOption, "display_type_rich", _value_word),
        (core.TyperArgument, "display_type_rich", _argument_word),
        (core.TyperArgument, "_usage_display_name", _usage_name),
    )
    for cls, name, replacement in patches:
        if hasattr(cls, name):
            setattr(cls, name, replacement)


def usage_error_line(error: Any) -> str:
    """One line for a click usage error, naming the help to read."""
    ctx = getattr(error, "ctx", None)
    where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
    message = error.format_message().replace("\n", " ").strip()
    return f"error: {message[:1].lower()}{message[1:]}{where}"


def is_click_error(error: BaseException) -> bool:
    """Click's exceptions (vendored by newer Typer, so no one class to name) carry these two."""
    return hasattr(error, "format_message") and hasattr(error, "exit_code")


def report(error: BaseException) -> int:
    """Print a usage problem or click error in one line on stderr; the exit status."""
    if isinstance(error, UsageProblem):
        print(f"error: {printable(error)}", file=sys.stderr)
        return 2
    print(printable(usage_error_line(error)), file=sys.stderr)
    return int(getattr(error, "exit_code", 2))
