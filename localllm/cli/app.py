"""The Typer application object; command modules register themselves on it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="localllm",
    help="Run quantized LLMs locally: chat, run, serve, bench, and manage GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _commands() -> None:
    # Keeps `localllm COMMAND` a group even when only the invoked command is registered (see
    # localllm.cli.register_commands): Typer runs a lone command as the whole program.
    pass
