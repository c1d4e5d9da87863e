"""One rule per fact across the front ends: `run` takes --chat-template as `chat` does, and the Python
API applies a models.toml entry's sampling defaults and chat template the way the CLI does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.sampling_params import BUILTIN_DEFAULTS, SamplingParams
from localllm.tokenizer.chat_template import TemplateError


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without a chat template (a base model)."""
    import gguf
    from tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("base") / "base.Q8_0.gguf"
    original = gguf.GGUFWriter.add_chat_template
    gguf.GGUFWriter.add_chat_template = lambda self, value: None  # type: ignore[method-assign]
    try:
        return write_tiny_model(path)
    finally:
        gguf.GGUFWriter.add_chat_template = original  # type: ignore[method-assign]


def run_json(model: Path, tmp_path: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "localllm", "run", str(model), "hello", "--backend", "numpy", "-n", "2"]
    env = dict(os.environ, LOCALLLM_HOME=str(tmp_path / "home"))
    result = subprocess.run([*cmd, "--json", *extra], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_run_takes_chat_template(base_model: Path, tmp_path: Path) -> None:
    raw = run_json(base_model, tmp_path)  # no template anywhere: the prompt goes in as is
    chatml = run_json(base_model, tmp_path, "--chat-template", "chatml")
    assert chatml["prompt_tokens"] > raw["prompt_tokens"] + 4  # the <|im_start|>user ... wrapping


@pytest.fixture()
def registry(base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user models.toml naming the base model with sampling defaults and a template."""
    user = tmp_path / "models.toml"
    user.write_text(
        f"[models.tiny-base]\npath = {json.dumps(str(base_model))}\n"
        "[models.tiny-base.defaults]\ntemperature = 0.25\ntop_k = 7\nmax_tokens = 5\n"
        "chat_template = \"{% for m in messages %}{{ m['content'] }}{% endfor %}\"\n"
    )
    monkeypatch.setenv("LOCALLLM_MODELS", str(user))
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", os.environ.get("NUMBA_CACHE_DIR", str(tmp_path / "numba")))
    return user


def test_python_api_applies_models_toml_defaults(registry: Path) -> None:
    from localllm import LLM

    llm = LLM("tiny-base", backend="numpy", threads=1, max_num_seqs=2)
    params = llm.sampling_params(top_k=3)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.25, 3, 5)
    assert params.top_p == BUILTIN_DEFAULTS["top_p"]
    out = llm.generate("hello", {"seed": 1})[0]  # a dict: completed by the model's defaults
    assert out.generated_tokens <= 5
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.generated_tokens == 8  # a SamplingParams is used as given
    assert llm.apply_chat_template([{"role": "user", "content": "hello"}]) == llm.tokenizer.encode(
        "hello", add_special=True, parse_special=True
    )
    chatml = LLM("tiny-base", chat_template="chatml", backend="numpy", threads=1, max_num_seqs=2)
    assert len(chatml.apply_chat_template([{"role": "user", "content": "hello"}])) > 5


def test_python_api_refuses_a_model_without_template(base_model: Path, registry: Path) -> None:
    from localllm import LLM

    llm = LLM(str(base_model), backend="numpy", threads=1, max_num_seqs=2)
    with pytest.raises(TemplateError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
