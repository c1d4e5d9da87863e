"""`localllm info` and the `list` columns on the tiny fixture: figures recomputed here from its shape."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

from localllm.cli import info as _info  # registers the command
from localllm.cli import manage
from localllm.cli.app import app
from localllm.loading.file import GGUFFile
from localllm.model_info import (
    RUNTIME_BYTES,
    format_params,
    human_bytes,
    kv_bytes_per_token,
    short_template,
    summarize,
)
from localllm.registry import load_registry

# the tiny model's shape (tests/support/tiny_model.py)
LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB, CTX = 2, 64, 128, 4, 2, 3 + 256 + 10, 256
HEAD_DIM = DIM // HEADS
MATRICES = 1 + 7 * LAYERS  # token_embd + q, k, v, o, gate, up, down per layer (all Q8_0)
VECTORS = 1 + 2 * LAYERS  # output_norm + attn_norm, ffn_norm per layer (F32)
MATRIX_PARAMS = VOCAB * DIM + LAYERS * (2 * DIM * DIM + 2 * KV_HEADS * HEAD_DIM * DIM + 3 * FFN * DIM)
VECTOR_PARAMS = DIM * VECTORS
KV_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # f16 K and V (the default)
# a prompt token's float32 scratch: q, attention output, k, v, normed k, 4 dim-wide rows, 5 FFN-wide rows
ACT_PER_TOKEN = 4 * (2 * HEADS * HEAD_DIM + 3 * KV_HEADS * HEAD_DIM + 4 * DIM + 5 * FFN)


def _runtime(ctx: int) -> int:
    return RUNTIME_BYTES + min(ctx, 512) * ACT_PER_TOKEN  # a prompt chunk is at most 512 tokens


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALLLM_MODELS", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return {"COLUMNS": "160"}


def test_summary_of_the_tiny_model(tiny_model_path, index_dir):
    info = summarize(GGUFFile.open(tiny_model_path, index_dir))
    assert (info.architecture, info.n_layers, info.n_kv_heads, info.head_dim) == (
        "llama",
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert info.parameters == MATRIX_PARAMS + VECTOR_PARAMS and info.quant == "Q8_0"
    assert info.context_length == CTX and info.vocab_size == VOCAB and info.chat_template
    histogram = {t.type: t for t in info.tensor_types}
    assert set(histogram) == {"Q8_0", "F32"}
    assert (histogram["Q8_0"].count, histogram["Q8_0"].parameters) == (MATRICES, MATRIX_PARAMS)
    assert (histogram["F32"].count, histogram["F32"].parameters) == (VECTORS, VECTOR_PARAMS)
    assert histogram["F32"].bytes == 4 * VECTOR_PARAMS
    assert histogram["Q8_0"].bytes == MATRIX_PARAMS // 32 * 34  # 32 int8 + one f16 scale per block
    assert info.kv_bytes_per_token == KV_PER_TOKEN == kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM)
    memory = info.memory()
    assert memory["context"] == CTX and memory["kv_cache_bytes"] == KV_PER_TOKEN * CTX
    assert memory["weights_bytes"] == tiny_model_path.stat().st_size
    assert info.activation_bytes_per_token == ACT_PER_TOKEN and memory["runtime_bytes"] == _runtime(CTX)
    assert memory["total_bytes"] == tiny_model_path.stat().st_size + KV_PER_TOKEN * CTX + _runtime(CTX)


def test_info_json(tiny_model_path, env):
    result = CliRunner().invoke(app, ["info", str(tiny_model_path), "--json", "--ctx-size", "1000"], env=env)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (
        data["tensor_types"]["Q8_0"]["count"] == MATRICES and data["tensor_types"]["F32"]["count"] == VECTORS
    )
    assert data["parameters"] == MATRIX_PARAMS + VECTOR_PARAMS
    assert data["memory"] == {
        "weights_bytes": tiny_model_path.stat().st_size,
        "kv_cache_types": ["f16", "f16"],
        "kv_bytes_per_token": KV_PER_TOKEN,
        "context": 1000,
        "kv_cache_bytes": KV_PER_TOKEN * 1000,
        "prompt_chunk": 512,
        "scratch_bytes": 512 * ACT_PER_TOKEN,
        "runtime_bytes": _runtime(1000),
        "total_bytes": tiny_model_path.stat().st_size + KV_PER_TOKEN * 1000 + _runtime(1000),
        # on a GPU: the Q8_0 matrices' blocks as they are (34 bytes per 32 values), vectors in float32
        "device_weights_bytes": {
            "cpu": tiny_model_path.stat().st_size,
            "cuda": MATRIX_PARAMS // 32 * 34 + 4 * VECTOR_PARAMS,
        },
    }
    assert data["chat_template"].startswith("{% for message in messages %}")


def test_info_text(tiny_model_path, env):
    result = CliRunner().invoke(app, ["info", str(tiny_model_path)], env=env)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "llama" in out and format_params(MATRIX_PARAMS + VECTOR_PARAMS) in out and "Q8_0" in out
    assert f"{MATRICES}" in out and "F32" in out
    assert human_bytes(KV_PER_TOKEN) in out and human_bytes(KV_PER_TOKEN * CTX) in out and f"@ {CTX}" in out
    assert "{% endif %}" in out and "--full" not in out  # a short template is shown whole


def test_info_sizes_a_q8_0_kv_cache(tiny_model_path, tmp_path, env):
    """-ctk/-ctv q8_0: 34 bytes per 32 values (0.53x of f16); a head size 32 does not divide is refused."""
    from tiny_arch import Shape, write_arch_model

    path = write_arch_model(tmp_path / "hd32.gguf", "llama", n_layers=2, shape=Shape(dim=128, head_dim=32))
    q8 = ["-ctk", "q8_0", "-ctv", "q8_0"]
    result = CliRunner().invoke(app, ["info", str(path), "--json", *q8], env=env)
    assert result.exit_code == 0, result.output
    memory = json.loads(result.stdout)["memory"]
    assert memory["kv_cache_types"] == ["q8_0", "q8_0"]
    assert (
        memory["kv_bytes_per_token"]
        == 2 * 2 * KV_HEADS * 34
        == kv_bytes_per_token(2, KV_HEADS, 32) * 34 // 64
    )
    text = CliRunner().invoke(app, ["info", str(path), "-ctk", "q8_0"], env=env).stdout
    assert "(K 34/32 B (q8_0) + V 2 B (f16)) / 2" in text
    refused = CliRunner().invoke(app, ["info", str(tiny_model_path), *q8], env=env)
    assert refused.exit_code != 0 and "divisible by 32 (this model has 16)" in str(refused.exception)


def test_long_templates_are_shortened():
    long = "\n".join(f"{{# line {i} #}}" for i in range(40))
    text, cut = short_template(long)
    assert cut and text.count("\n") < 20 and long.startswith(text)
    assert short_template("{{ x }}") == ("{{ x }}", False)


def test_list_describes_downloaded_models(tiny_model_path, tmp_path, env):
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    shutil.copy(tiny_model_path, models / "tiny.gguf")
    (models / "junk.Q4_K_M.gguf").write_bytes(b"not a gguf")
    params = format_params(MATRIX_PARAMS + VECTOR_PARAMS)
    expected = {"arch": "llama", "params": params, "quant": "Q8_0", "context": "256"}
    assert manage.describe(models / "tiny.gguf") == expected
    assert manage.describe(models / "junk.Q4_K_M.gguf")["quant"] == "Q4_K_M"
    result = CliRunner().invoke(app, ["list"], env=env)
    assert result.exit_code == 0, result.output
    # piped (as here): tab-separated records under a header; on a terminal the same as a Rich table
    header, *rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert all(column in header for column in ("arch", "params", "quant", "context"))
    row = dict(zip(header, next(r for r in rows if r[0] == "tiny.gguf"), strict=True))
    assert row["arch"] == "llama" and row["quant"] == "Q8_0" and row["context"] == "256"
    console = Console(file=io.StringIO(), width=200)
    listed = manage.model_rows(load_registry(None), tmp_path / "home")
    console.print(manage.model_table(listed, manage.describe))
    table = console.file.getvalue()
    assert all(column in table for column in ("NAME", "ARCH", "PARAMS", "QUANT", "CONTEXT"))


def test_help_has_examples(env):
    for command in ("chat", "info"):
        import localllm.cli.chat  # noqa: F401

        result = CliRunner().invoke(app, [command, "--help"], env=env)
        assert (
            result.exit_code == 0 and "Examples:" in result.stdout and f"localllm {command}" in result.stdout
        )


def test_format_params():
    assert format_params(91264) == "91.3K" and format_params(134_515_008) == "135M"
    assert format_params(1_711_376_384) == "1.7B" and format_params(7_000_000_000) == "7B"


def test_memory_fit_verdicts():
    from localllm.model_info import memory_fit

    assert memory_fit(100, 60, available=200, total=400).verdict == "fits"
    tight = memory_fit(300, 60, available=200, total=400)
    assert tight.verdict == "tight" and "free now" in tight.message
    too_big = memory_fit(500, 60, available=200, total=400)
    assert too_big.verdict == "too big" and "weights, KV cache and runtime need" in too_big.message
    assert "docs/scaling.md" in too_big.message
    assert "weights alone" in memory_fit(900, 800, available=200, total=400).message


def test_info_says_when_a_model_cannot_fit(tiny_model_path, env, monkeypatch):
    # a machine with less RAM than the tiny model's file: the verdict is plain, in text and JSON
    size = tiny_model_path.stat().st_size
    monkeypatch.setattr(_info, "machine_memory", lambda: (size // 4, size // 2))
    result = CliRunner().invoke(app, ["info", str(tiny_model_path)], env=env)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "does not fit: its weights alone need" in text and "docs/scaling.md" in text
    assert f"@ {CTX:,} tokens of context" in text  # the trained 256, under the default cap
    result = CliRunner().invoke(app, ["info", str(tiny_model_path), "--json", "-c", "64"], env=env)
    fit = json.loads(result.stdout)["fit"]
    assert fit["verdict"] == "too big" and fit["context"] == 64
    assert fit["needed_bytes"] == size + KV_PER_TOKEN * 64 + _runtime(64) and fit["total_bytes"] == size // 2
    room = 10 * size + 2 * _runtime(CTX)  # the runtime (Python, Numba, kernels) dwarfs the tiny file
    monkeypatch.setattr(_info, "machine_memory", lambda: (room, 2 * room))
    result = CliRunner().invoke(app, ["info", str(tiny_model_path), "--json"], env=env)
    assert json.loads(result.stdout)["fit"]["verdict"] == "fits"
