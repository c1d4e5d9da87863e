"""Shared fixtures: the tiny random GGUF model, and the real SmolLM2 model (downloaded once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_model import write_tiny_model

from localllm.llm import default_numba_cache

DATA = Path(__file__).parent / "data"

# Kernels compile into (or load from) the folder named by a hash of all kernel sources, as the CLI and
# the Python API do, before any test imports them: Numba's own cache only notices a change in a
# function's own file, so after an edit to an inlined helper it could run stale machine code.
default_numba_cache()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.Q8_0.gguf")


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("index")


def _model_home() -> Path:
    return Path(os.environ.get("LOCALLLM_HOME", "~/.cache/localllm")).expanduser()


def _resolve(name: str) -> Path:
    from localllm.registry import load_registry, resolve_model

    return resolve_model(name, _model_home(), load_registry(None), progress=False).path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model: $LOCALLLM_TEST_MODEL, else the localllm cache (pulled on first use)."""
    explicit = os.environ.get("LOCALLLM_TEST_MODEL")
    return Path(explicit) if explicit else _resolve("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """gemma-3-270m from the localllm cache (pulled on first use)."""
    return _resolve("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen25c_path() -> Path:
    """qwen2.5-coder-0.5b-instruct from the localllm cache (pulled on first use)."""
    return _resolve("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def model_index_dir() -> Path:
    """The CLI's own GGUF index cache: parsing a 262k vocabulary takes ~20 s, its cached index ~0.2 s."""
    return _model_home() / "index"
