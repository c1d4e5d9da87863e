"""Command-line entry point. Command modules import their heavy dependencies inside the commands."""

from __future__ import annotations

import gc
import importlib
import os
import sys

# Command -> the module that registers it.  Only the invoked command's module is imported: the others
# cost start-up time (parsing, Typer's decorators) for nothing.
COMMANDS = {
    "bench": "bench",
    "chat": "chat",
    "convert": "convert",
    "info": "info",
    "list": "manage",
    "perplexity": "perplexity",
    "pull": "manage",
    "quantize": "quantize",
    "rm": "manage",
    "run": "run",
    "serve": "serve",
    "tokenize": "tokenize",
}


def register_commands(argv: list[str]) -> None:
    """Import the module of the command argv[0] names; all of them for anything else (--help, typos)."""
    wanted = [COMMANDS[argv[0]]] if argv and argv[0] in COMMANDS else sorted(set(COMMANDS.values()))
    for module in wanted:
        importlib.import_module(f"localllm.cli.{module}")


def main() -> None:
    from typer import Abort

    from localllm.cli import help
    from localllm.cli.app import app
    from localllm.errors import LocalLLMError
    from localllm.printable import printable

    register_commands(sys.argv[1:])
    try:
        # Not standalone: usage errors come here, to be printed as one line (help.report).
        status = app(prog_name="localllm", standalone_mode=False)
        sys.exit(status if isinstance(status, int) else 0)
    except LocalLLMError as e:  # its text may quote a file's strings: escaped, never acted on
        print(f"error: {printable(e)}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # `localllm list | head`: the reader left; say nothing, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(141)
    except OSError as e:  # the environment (a read-only or full disk), never a bug: one line too
        print(f"error: {printable(e)}", file=sys.stderr)
        sys.exit(1)
    except MemoryError:
        print("error: out of memory", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, Abort):
        sys.exit(130)
    except help.UsageProblem as e:
        sys.exit(help.report(e))
    except Exception as e:
        if not help.is_click_error(e):
            raise
        sys.exit(help.report(e))
    finally:
        # Everything still alive is freed by the exit itself; frozen, it is not also scanned by the
        # interpreter's final collection (slow after a model was loaded).
        gc.freeze()
