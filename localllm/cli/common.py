"""Options shared by the commands, and the one place where flags become configuration."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from localllm.config import DEFAULT_CONTEXT

Threads = Annotated[int, typer.Option("--threads", "-t", help="CPU threads (0 = physical cores).")]
CtxSize = Annotated[
    int,
    typer.Option(
        "--ctx-size",
        "-c",
        help="Context length in tokens; 0 = the model's models.toml context, else its trained one "
        f"up to {DEFAULT_CONTEXT} (the same in run, chat and serve).",
    ),
]
CacheTypeK = Annotated[
    str, typer.Option("--cache-type-k", "-ctk", help="KV cache type for keys: f16, f32 or q8_0.")
]
CacheTypeV = Annotated[
    str, typer.Option("--cache-type-v", "-ctv", help="KV cache type for values: f16, f32 or q8_0.")
]
KvDiskMb = Annotated[
    int | None,
    typer.Option(
        "--kv-disk-mb",
        metavar="MIB",
        help="Keep the prefix cache's blocks on disk too, up to this many MiB, so a restart (or another "
        "process serving the same model) finds long prompts computed; 0 = off. "
        "[default: off for run; serve: 4096, at most a quarter of the free disk]",
    ),
]
KvDiskDir = Annotated[
    Path | None,
    typer.Option(
        "--kv-disk-dir",
        metavar="DIR",
        help="Where --kv-disk-mb keeps its files. [default: LOCALLLM_HOME/kv-cache]",
    ),
]
Backend = Annotated[str, typer.Option("--backend", help="numba (CPU kernels), numpy (reference) or torch.")]
Device = Annotated[
    str, typer.Option("--device", help="--backend torch: auto (CUDA, then MPS, then CPU), cuda, mps or cpu.")
]
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
LoopGuard = Annotated[
    bool,
    typer.Option(
        "--loop-guard/--no-loop-guard",
        help="End a reply that keeps repeating the same passage, with a notice.",
    ),
]
PromptLookup = Annotated[
    bool,
    typer.Option(
        "--prompt-lookup",
        help="Speculative decoding without a second model: draft the tokens that followed the text's "
        "latest n-gram earlier in the prompt or output (fast where answers copy the prompt: code edits).",
    ),
]
DraftModel = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        metavar="NAME|PATH",
        help="Speculative decoding with this smaller model of the same vocabulary drafting tokens "
        "(e.g. Qwen2.5-Coder-0.5B for the 1.5B).",
    ),
]
DraftMax = Annotated[
    int, typer.Option("--draft-max", help="Speculative decoding: most tokens drafted per sequence and step.")
]
DraftVocab = Annotated[
    int,
    typer.Option(
        "--draft-vocab",
        metavar="N",
        help="A draft model's output layer scores only the first N token ids (and the special ones): "
        "cheaper drafts, the frequent tokens kept. 0: all.",
    ),
]
Quantize = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="int8 or int4: quantize a Hugging Face directory (or an F16 GGUF) on load, once; cached "
        "under LOCALLLM_HOME/converted.",
    ),
]
GroupSize = Annotated[int, typer.Option("--group-size", help="Weights per --quantize scale (32 only).")]
JsonSchemaFile = Annotated[
    Path | None,
    typer.Option(
        "--json-schema", help="Constrain the output to this JSON schema (a .json file).", metavar="FILE"
    ),
]
GrammarFile = Annotated[
    Path | None,
    typer.Option(
        "--grammar", help="Constrain the output to this GBNF or Lark grammar (a file).", metavar="FILE"
    ),
]
ReasoningBudget = Annotated[
    int | None,
    typer.Option(
        "--reasoning-budget",
        help="Tokens a thinking model may reason before its thinking is closed with its own end tag "
        "(0: none; -1 or unset: no limit).",
        min=-1,
    ),
]
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
        # One rule in every command: the flag, else the models.toml context, else the engine's
        # (the trained context up to DEFAULT_CONTEXT).
        ctx_size=ctx_size or int((defaults or {}).get("context") or 0),
        index_dir=model_home() / "index",
        sampling_defaults=dict(defaults or {}),
        **extra,
    )


F16_KV = ("f16", "f16")


def kv_disk_options(mb: int | None, directory: Path | None, default_on: bool) -> dict[str, Any]:
    """The EngineConfig fields of the prefix cache's disk tier: `mb` MiB in `directory` (None: the
    defaults, which turn it on only where `default_on`: serve)."""
    from localllm.engine.kv_disk import default_budget_mb, default_dir
    from localllm.errors import ConfigError

    if mb is not None and mb < 0:
        raise ConfigError(f"--kv-disk-mb must be 0 (off) or more, not {mb}")
    directory = Path(directory).expanduser() if directory is not None else default_dir(model_home())
    if mb is None:
        mb = default_budget_mb(directory) if default_on else 0
    return {"kv_disk_mb": mb, "kv_disk_dir": directory}


def one_shot_cache_options(mb: int | None, directory: Path | None) -> dict[str, Any]:
    """`run`'s prefix cache: one prompt, then the process exits, so a cache serves only a later
    process, through the disk tier (off unless asked for). Without it, no prefix caching: a recurrent
    model's state snapshots would be copies no one reads (19 MiB each for a 0.8B qwen35)."""
    options = kv_disk_options(mb, directory, default_on=False)
    return options | {"enable_prefix_caching": options["kv_disk_mb"] > 0}


def kernels_compiled() -> bool:
    """Whether Numba's cache (NUMBA_CACHE_DIR) holds this version's kernels, as a first run leaves it."""
    from localllm.kernels.cache import sources_digest

    kernels = Path(os.environ.get("NUMBA_CACHE_DIR", "")) / f"localllm-kernels-{sources_digest()}"
    return kernels.is_dir() and any(kernels.glob("*.nbi"))


def spec_options(
    prompt_lookup: bool, draft_model: str | None, draft_max: int, draft_vocab: int
) -> dict[str, Any]:
    """The EngineConfig fields of speculative decoding, checked before any model loads; a draft model
    named from the registry is pulled on first use, like the main one."""
    from localllm.errors import ConfigError

    if prompt_lookup and draft_model:
        raise ConfigError("choose one way to draft: --prompt-lookup or --draft-model, not both")
    if draft_max < 1:
        raise ConfigError(f"--draft-max must be at least 1, not {draft_max}")
    if draft_vocab < 0:
        raise ConfigError(f"--draft-vocab must be 0 (all) or more, not {draft_vocab}")
    path = str(resolve(draft_model)[0]) if draft_model else None
    return {
        "prompt_lookup": prompt_lookup,
        "draft_model": path,
        "draft_max": draft_max,
        "draft_vocab": draft_vocab,
    }


def first_run_steps(backend: str, model: Path | None = None) -> list[str]:
    """The one-time steps the next load will take: compiling the kernels (per localllm version and CPU),
    repacking a model's weights for them (per model file).  Both are cached afterwards."""
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if backend != "numba" or not cache:
        return []
    steps = []
    if not kernels_compiled():
        steps.append("compiling the kernels for this CPU")
    if model is not None:
        from localllm.backends.weight_cache import cache_files

        if not cache_files(model, model_home() / "index"):
            steps.append(f"repacking the weights of {model.name}")
    return steps


def first_run_notice(backend: str, model: Path | None = None) -> list[str]:
    """On a terminal, say what a first run does and that it takes a while: else minutes of silence."""
    steps = first_run_steps(backend, model) if sys.stderr.isatty() else []
    if steps:
        print(f"first run: {' and '.join(steps)} (about 1-2 min, once; cached after)", file=sys.stderr)
    return steps


@contextlib.contextmanager
def loading(backend: str, model: Path | None = None) -> Iterator[None]:
    """Around a command's one engine load: no garbage collection while it creates the many objects that
    live until exit (Numba's compiler state, the vocabulary, the model), then a freeze so no later
    collection rescans them.  Collections during the load add to start-up.  A first run says what it does
    and, after, how long it took."""
    steps = first_run_notice(backend, model)
    start = time.perf_counter()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    if steps:
        print(
            f"{steps[0][0].upper()}{' and '.join(steps)[1:]}: done in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )


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
    "loop_guard",
)


def sampling_flags(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling flags among a command's arguments (its `locals()`), checked now so that a bad value
    (--top-p 2) is refused before the model loads, not after."""
    from localllm.sampling_params import resolve_sampling

    flags = {name: arguments[name] for name in SAMPLING_FLAGS}
    flags["stop"] = flags["stop"] or None
    resolve_sampling(flags)
    return flags


def structured_spec(json_schema: Path | None, grammar: Path | None) -> Any:
    """The constraint --json-schema / --grammar ask for (read now: a bad file fails before loading)."""
    from localllm.errors import ConfigError
    from localllm.structured.spec import StructuredSpec

    if json_schema is not None and grammar is not None:
        raise ConfigError("give --json-schema or --grammar, not both")
    path = json_schema or grammar
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if json_schema is not None:
        return StructuredSpec.json_schema(text, f"--json-schema {path}")
    return StructuredSpec("lark" if path.suffix == ".lark" else "grammar", text, f"--grammar {path}")


def sampling_params(engine: Any, flags: Mapping[str, Any], builtin: Mapping[str, Any] | None = None) -> Any:
    """Flags given on the command line > the model's defaults (models.toml, then the GGUF) > `builtin`:
    resolve_sampling's rule, the same the Python API and the server apply."""
    from localllm.sampling_params import BUILTIN_DEFAULTS

    return engine.sampling_params(flags, BUILTIN_DEFAULTS if builtin is None else builtin)


def resolve(
    model: str | None,
    backend: str | None = None,
    threads: int = 0,
    cache_types: tuple[str, str] = F16_KV,
    quantize: str | None = None,
    group_size: int = 32,
) -> tuple[Path, dict[str, Any]]:
    """The model file (pulled on first use) and its registry defaults. With the numba `backend` on a
    first run, the model's kernels (for `threads` and `cache_types`) compile while it downloads.
    A Hugging Face directory (or a float GGUF with `quantize`) is converted once (convert/on_load.py)."""
    from localllm.llm import default_numba_cache, resolve_with_defaults

    home = model_home()
    default_numba_cache()
    prewarm = _start_prewarm(model, home, threads, cache_types) if backend == "numba" else None
    resolved = resolve_with_defaults(model, home, quantize=quantize, group_size=group_size)
    if prewarm is not None and (seconds := prewarm.join()) is not None:
        print(f"Compiled the kernels in {seconds:.0f} s, while downloading", file=sys.stderr)
    return resolved


def _start_prewarm(model: str | None, home: Path, threads: int, cache_types: tuple[str, str]) -> Any:
    """A KernelPrewarm started when the model is still to be downloaded and the kernels to be compiled."""
    from localllm.prewarm import tensor_types
    from localllm.registry import default_user_registry, load_registry, models_dir

    if kernels_compiled():
        return None
    registry = load_registry(default_user_registry())
    entry = registry.find(model or registry.default_model)
    if entry is None or entry.is_local or (models_dir(home) / entry.file_name).is_file():
        return None
    types = tensor_types(entry, entry.file_name)
    if types is None:
        return None
    from localllm.prewarm import KernelPrewarm

    print("first run: compiling the kernels for this CPU while the model downloads", file=sys.stderr)
    return KernelPrewarm(types, threads, cache_types).start()
