"""The Typer application object; command modules register themselves on it."""

from __future__ import annotations

from typing import Annotated

import typer

from localllm.cli import help

help.install()

app = typer.Typer(
    name="localllm",
    help="Run quantized LLMs locally: chat, run, serve, bench, and manage GGUF models.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion: tab completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from localllm import __version__

        print(f"localllm {__version__}")
        raise typer.Exit()


@app.callback()
def _commands(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_print_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    # Keeps `localllm COMMAND` a group even when only the invoked command is registered (see
    # localllm.cli.register_commands): Typer runs a lone command as the whole program.
    pass
