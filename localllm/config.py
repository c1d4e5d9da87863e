"""Configuration dataclasses, built once at the edge (CLI flags, models.toml) and passed down."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import ConfigError


def physical_cores() -> int:
    """Physical cores (hyper-threads share a core's vector units, so they do not help here)."""
    n = _sysfs_cores()
    if n:
        return n
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except ImportError:
        pass
    return max(1, (os.cpu_count() or 2))


def _sysfs_cores() -> int:
    """Linux: one distinct sibling list per physical core, read as psutil does (importing psutil
    costs every start ~20 ms); 0 where sysfs does not say."""
    cpus = "/sys/devices/system/cpu/cpu[0-9]*/topology/"
    paths = glob.glob(cpus + "core_cpus_list") or glob.glob(cpus + "thread_siblings_list")
    siblings = set()
    for path in paths:
        try:
            with open(path) as f:
                siblings.add(f.read().strip())
        except OSError:
            return 0
    return len(siblings)


# The context a command gets when neither its flag nor models.toml sets one: the model's trained context up
# to this, in run, chat, serve and the Python API alike (a bigger KV cache costs memory up front).
DEFAULT_CONTEXT = 8192
PROMPT_CHUNK = 512  # tokens a step computes at most (max_num_batched_tokens): a prompt's chunk
DRAFT_VOCAB = 32768  # rows of a draft model's output layer (engine/loaded_model.py's head_ids)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # path to a .gguf (already resolved)
    backend: str = "numba"  # numba | numpy | torch
    device: str = "auto"  # the torch backend's: auto (CUDA, then MPS, then CPU) | cuda | mps | cpu
    threads: int = 0  # 0 = physical cores
    ctx_size: int = 0  # 0 = the model's trained context, capped at max_default_ctx
    max_num_seqs: int = 16  # --parallel
    max_num_batched_tokens: int = PROMPT_CHUNK
    block_size: int = 16
    kv_cache_mb: int = 0  # 0 = sized from ctx_size x max_num_seqs (shared, never split per sequence)
    num_kv_blocks: int = 0  # exact pool size, overriding the two above (tests, benchmarks)
    enable_prefix_caching: bool = True
    index_dir: Path | None = None  # where parsed GGUF indexes and repacked weights are cached
    max_default_ctx: int = DEFAULT_CONTEXT
    # The prefix cache's disk tier (engine/kv_disk.py): its budget in MiB (0: off) and its directory
    # (None: LOCALLLM_HOME/kv-cache, from index_dir's parent).
    kv_disk_mb: int = 0
    kv_disk_dir: Path | None = None
    cache_type_k: str = "f16"  # KV cache element types (llama.cpp's --cache-type-k/-v): f16, f32 or q8_0
    cache_type_v: str = "f16"
    # The model's models.toml defaults (only the sampling keys are read): what a request that leaves a
    # sampling value unset gets, before the built-in default (see sampling_params.resolve_sampling).
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Speculative decoding (engine/spec_decode.py): drafts from prompt lookup, or from a smaller model of
    # the same vocabulary (a resolved .gguf path), at most draft_max tokens per sequence and step.
    prompt_lookup: bool = False
    draft_model: str | None = None
    draft_max: int = 8
    draft_vocab: int = DRAFT_VOCAB  # the draft's output layer scores the first N ids (0: all)

    def __post_init__(self) -> None:
        if self.backend not in ("numba", "numpy", "torch"):
            raise ConfigError(f"unknown backend '{self.backend}' (choose numba, numpy or torch)")
        if self.device not in ("auto", "cuda", "mps", "cpu"):
            raise ConfigError(f"unknown device '{self.device}' (choose auto, cuda, mps or cpu)")
        self._check_cache_types()
        for name in ("threads", "ctx_size", "kv_cache_mb", "num_kv_blocks", "kv_disk_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0")
        if self.prompt_lookup and self.draft_model:
            raise ConfigError("choose one way to draft: --prompt-lookup or --draft-model, not both")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "draft_max"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")

    def _check_cache_types(self) -> None:
        from localllm.backends.kv_types import CACHE_TYPE_NAMES

        for name in ("cache_type_k", "cache_type_v"):
            value, flag = getattr(self, name), f"--{name.replace('_', '-')}"
            if value not in CACHE_TYPE_NAMES:
                raise ConfigError(f"{flag} {value} is not supported (choose {', '.join(CACHE_TYPE_NAMES)})")

    @property
    def speculative(self) -> bool:
        return self.prompt_lookup or bool(self.draft_model)

    @property
    def num_threads(self) -> int:
        return self.threads or physical_cores()
