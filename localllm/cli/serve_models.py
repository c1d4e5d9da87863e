"""The models one `localllm serve` serves: the MODEL arguments and --models-dir's files, each resolved
(a registry name pulled on first use), with its engine configuration, its names, and the memory it is
estimated to need (`localllm info`'s estimate: the file plus the KV cache the server gives it)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localllm.errors import ConfigError

SHARD = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")  # gguf-split's file names; the first opens the set


def model_names(models: list[str] | None, models_dir: Path | None) -> list[str | None]:
    """What to serve: the arguments, then each .gguf file of `models_dir` (a split model's first
    file only); no argument and no directory: the registry's default model (None)."""
    names: list[str | None] = list(models or [])
    if models_dir is not None:
        directory = Path(models_dir).expanduser()
        if not directory.is_dir():
            raise ConfigError(f"--models-dir {directory}: not a directory")
        files = sorted(p for p in directory.glob("*.gguf") if _first_file(p))
        if not files:
            raise ConfigError(f"--models-dir {directory}: no .gguf files there")
        names += [str(p) for p in files]
    return names or [None]


def _first_file(path: Path) -> bool:
    match = SHARD.search(path.name)
    return match is None or int(match.group(1)) == 1


def check_single_model_flags(count: int, flags: dict[str, Any]) -> None:
    """Flags that name one model's settings refuse a server of several."""
    if count == 1:
        return
    for flag, value in flags.items():
        if value:
            raise ConfigError(f"{flag} applies to one model; this server has {count}")


def memory_estimate(path: Path, config: Any) -> int:
    """Bytes a model needs as the server runs it: the file (memory-mapped weights), its KV pool (a
    context per parallel sequence, or --kv-cache-mb) with the per-token size `info` shows, and a prompt
    chunk's scratch (the runtime itself, Python and Numba, is the process's, shared by every model)."""
    from localllm.loading.file import GGUFFile
    from localllm.model_info import summarize

    summary = summarize(GGUFFile.open(path, config.index_dir))
    context = config.ctx_size or min(summary.context_length or 0, config.max_default_ctx)
    memory = summary.memory(context)
    if config.kv_cache_mb:
        kv = config.kv_cache_mb * 2**20
    else:
        kv = (memory["kv_cache_bytes"] or 0) * config.max_num_seqs
    return int(memory["weights_bytes"] + kv + memory["scratch_bytes"])


def served_models(
    names: list[str | None],
    resolve: Callable[[str | None], tuple[Path, dict[str, Any], Any]],
    base: Any,
    served_id: Callable[[str | None, Path], str],
) -> list[Any]:
    """A model_pool.ServedModel per name: `resolve(name)` gives its file, registry defaults and engine
    configuration; `base` (a ServerConfig) the server's settings it shares."""
    from localllm.engine.engine import LLMEngine
    from localllm.server.model_pool import ServedModel
    from localllm.tokenizer.chat_template import chat_template_source

    out, seen = [], set()
    for name in names:
        path, defaults, engine_config = resolve(name)
        model_id = served_id(name, path)
        if model_id.lower() in seen:
            raise ConfigError(f"two models would be served as '{model_id}'")
        seen.add(model_id.lower())
        config = dataclasses.replace(
            base,
            model_id=model_id,
            model_aliases=tuple({path.name, path.stem, *([name] if name else [])}),
            chat_template=chat_template_source(None, defaults.get("chat_template")),
            on_load_error=None,  # one model failing to load fails its requests, not the server
        )
        factory = _factory(LLMEngine, engine_config)
        out.append(ServedModel(config, factory, memory_estimate(path, engine_config)))
    return out


def _factory(engine_class: Any, config: Any) -> Callable[[], Any]:
    return lambda: engine_class(config)
