"""Command-line entry point. Command modules import their heavy dependencies inside the commands."""

from __future__ import annotations

import sys


def main() -> None:
    from localllm.cli import bench, chat, info, manage, run, serve, tokenize  # noqa: F401  (registers commands)
    from localllm.cli.app import app
    from localllm.errors import LocalLLMError

    try:
        app()
    except LocalLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
