"""`localllm serve A B` and --models-dir: the models a server serves, their names and memory estimates,
the pool's flags, and the one-model flags a server of several refuses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tiny_model import write_tiny_model
from typer.testing import CliRunner

import localllm.cli.serve as serve
from localllm.cli.app import app
from localllm.cli.serve_models import check_single_model_flags, model_names
from localllm.errors import ConfigError


def test_models_dir_lists_each_model_once(tmp_path: Path) -> None:
    for name in ("b.gguf", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert model_names(["x.gguf"], tmp_path) == [
        "x.gguf",
        str(tmp_path / "a-00001-of-00002.gguf"),
        str(tmp_path / "b.gguf"),
    ]
    assert model_names(None, None) == [None]  # the registry's default
    with pytest.raises(ConfigError, match="not a directory"):
        model_names(None, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .gguf"):
        model_names(None, tmp_path / "empty")


def test_one_model_flags_refuse_several() -> None:
    check_single_model_flags(1, {"--alias": ["x"]})
    check_single_model_flags(3, {"--alias": None, "--draft-model": None})
    with pytest.raises(ConfigError, match="--alias applies to one model; this server has 2"):
        check_single_model_flags(2, {"--alias": ["x"]})


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(serve, "run_server", lambda *a: calls.append(a))
    return calls


def test_serve_several_models(tmp_path: Path, captured: list[tuple[Any, ...]]) -> None:
    a = write_tiny_model(tmp_path / "tiny-a.Q8_0.gguf", seed=0)
    (tmp_path / "more").mkdir()
    b = write_tiny_model(tmp_path / "more" / "tiny-b.Q8_0.gguf", seed=1)
    flags = [
        "--keep-alive",
        "10m",
        "--max-loaded",
        "1",
        "--max-memory-mb",
        "64",
        "--parallel",
        "2",
        "-c",
        "128",
    ]
    r = CliRunner().invoke(
        app, ["serve", str(a), "--models-dir", str(tmp_path / "more"), "--backend", "numpy", *flags]
    )
    assert r.exit_code == 0, r.output
    factory, base, _, _, models, limits = captured[-1]
    assert factory is None and [m.config.model_id for m in models] == ["tiny-a.Q8_0", "tiny-b.Q8_0"]
    assert models[1].config.accepts_model("tiny-b.Q8_0.gguf") and not models[0].config.accepts_model(
        "tiny-b.Q8_0"
    )
    assert (limits.keep_alive, limits.max_loaded, limits.max_memory) == (600, 1, 64 * 2**20)
    kv_pool = (
        2 * 128 * (2 * 2 * 2 * 16 * 2)
    )  # sequences x context x (K and V, layers, KV heads, head dim, f16)
    scratch = 128 * 4 * (2 * 64 + 3 * 32 + 4 * 64 + 5 * 128)  # a 128-token prompt chunk (see test_info)
    assert models[1].memory_bytes == b.stat().st_size + kv_pool + scratch
    r = CliRunner().invoke(app, ["serve", str(a), "--backend", "numpy"])
    assert r.exit_code == 0 and captured[-1][0] is not None  # one model: loaded at start, as always


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--keep-alive", "soon"], "--keep-alive: not a duration"),
        (["--max-loaded", "-1"], "--max-loaded must be 0 (no limit) or more"),
        (["--load-timeout", "0"], "--load-timeout must be at least 0.1 s"),
    ],
)
def test_bad_pool_flags_are_usage_errors(flags: list[str], message: str, captured: list[Any]) -> None:
    r = CliRunner().invoke(app, ["serve", "a.gguf", "b.gguf", *flags])
    assert r.exit_code == 2 and message in r.output and not captured


def test_keep_alive_default_is_five_minutes() -> None:
    assert (
        serve._pool_limits(
            serve.SimpleNamespace(keep_alive="5m", max_loaded=0, max_memory_mb=0, load_timeout=600)
        ).keep_alive
        == 300
    )
    assert (
        serve._pool_limits(
            serve.SimpleNamespace(keep_alive="-1", max_loaded=0, max_memory_mb=0, load_timeout=1)
        ).keep_alive
        == math.inf
    )


def test_a_served_model_is_estimated_with_its_kv_pool_and_prompt_scratch(tiny_model_path, index_dir) -> None:
    from localllm.cli.serve_models import memory_estimate
    from localllm.config import EngineConfig
    from localllm.loading.file import GGUFFile
    from localllm.model_info import summarize

    config = EngineConfig(model=str(tiny_model_path), ctx_size=200, max_num_seqs=3, index_dir=index_dir)
    info = summarize(GGUFFile.open(tiny_model_path, index_dir))
    kv = info.kv_bytes_per_token * 200 * 3  # a context per parallel sequence
    scratch = 200 * info.activation_bytes_per_token  # a prompt chunk of min(200, 512) tokens
    assert memory_estimate(tiny_model_path, config) == tiny_model_path.stat().st_size + kv + scratch
    sized = EngineConfig(model=str(tiny_model_path), ctx_size=200, kv_cache_mb=5, index_dir=index_dir)
    assert memory_estimate(tiny_model_path, sized) == tiny_model_path.stat().st_size + 5 * 2**20 + scratch
