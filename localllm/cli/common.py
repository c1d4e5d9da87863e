"""Options shared by the commands, and the one place where flags become configuration."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

Threads = Annotated[int, typer.Option("--threads", "-t", help="CPU threads (0 = physical cores).")]
CtxSize = Annotated[
    int, typer.Option("--ctx-size", "-c", help="Context length in tokens (0 = model default).")
]
Backend = Annotated[str, typer.Option("--backend", help="numba (CPU kernels), numpy (reference) or torch.")]
Temperature = Annotated[
    float | None, typer.Option("--temperature", "--temp", help="0 = greedy. [default: 0.8 or the model's]")
]
TopP = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling. [default: 0.95]")]
TopK = Annotated[int | None, typer.Option("--top-k", help="Top-k sampling, 0 = off. [default: 40]")]
MinP = Annotated[float | None, typer.Option("--min-p", help="Min-p sampling. [default: 0.05]")]
RepeatPenalty = Annotated[float | None, typer.Option("--repeat-penalty", help="1.0 = off. [default: 1.0]")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="OpenAI presence penalty.")]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help="OpenAI frequency penalty.")]
Seed = Annotated[int | None, typer.Option("--seed", "-s", help="Random seed for reproducible sampling.")]
MaxTokens = Annotated[
    int | None,
    typer.Option("--max-tokens", "-n", help="Tokens to generate (default 256; -1 = until context)."),
]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
ChatTemplateOption = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="Jinja template text, a file holding one, or 'chatml' (for models without one).",
    ),
]


def model_home() -> Path:
    from localllm.registry import default_home

    return default_home()


def engine_config(
    model_path: Path,
    backend: str,
    threads: int,
    ctx_size: int,
    defaults: Mapping[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """The engine's configuration; `defaults` (the models.toml entry's) give its sampling defaults."""
    from localllm.config import EngineConfig

    return EngineConfig(
        model=str(model_path),
        backend=backend,
        threads=threads,
        ctx_size=ctx_size,
        index_dir=model_home() / "index",
        sampling_defaults=dict(defaults or {}),
        **extra,
    )


def first_run_notice(backend: str) -> None:
    """On a terminal, say that the first run compiles the kernels: else a minute or two of silence."""
    cache = Path(os.environ.get("NUMBA_CACHE_DIR", "."))
    if backend == "numba" and sys.stderr.isatty() and (not cache.is_dir() or not any(cache.iterdir())):
        print(
            "first run of this localllm version: compiling its kernels for this CPU (~1-2 min)",
            file=sys.stderr,
        )


@contextlib.contextmanager
def loading(backend: str) -> Iterator[None]:
    """Around a command's one engine load: no garbage collection while it creates ~1M objects that live
    until exit (Numba's compiler state, the vocabulary, the model), then a freeze so no later collection
    rescans them.  Collections during the load cost ~0.1 s of start-up."""
    first_run_notice(backend)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "stop",
)


def sampling_flags(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling flags among a command's arguments (its `locals()`), checked now so that a bad value
    (--top-p 2) is refused before the model loads, not after."""
    from localllm.sampling_params import resolve_sampling

    flags = {name: arguments[name] for name in SAMPLING_FLAGS}
    flags["stop"] = flags["stop"] or None
    resolve_sampling(flags)
    return flags


def sampling_params(engine: Any, flags: Mapping[str, Any], builtin: Mapping[str, Any] | None = None) -> Any:
    """Flags given on the command line > the model's defaults (models.toml, then the GGUF) > `builtin`:
    resolve_sampling's rule, the same the Python API and the server apply."""
    from localllm.sampling_params import BUILTIN_DEFAULTS

    return engine.sampling_params(flags, BUILTIN_DEFAULTS if builtin is None else builtin)


def resolve(model: str | None) -> tuple[Path, dict[str, Any]]:
    """The model file (pulled on first use) and its registry defaults."""
    from localllm.llm import default_numba_cache, resolve_with_defaults

    home = model_home()
    default_numba_cache(home)
    return resolve_with_defaults(model, home)
