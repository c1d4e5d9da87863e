"""Quantize on load: `LLM(HF_DIR, quantize=...)` and `localllm run HF_DIR --quantize` convert once into
LOCALLLM_HOME/converted and run on the same kernels as any GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_arch import write_arch_model
from typer.testing import CliRunner

from localllm.cli import run as _run  # noqa: F401  (registers the command)
from localllm.cli.app import app
from localllm.convert.export_hf import export_hf
from localllm.convert.on_load import prepare_model, target_type
from localllm.engine.engine import score_tokens
from localllm.errors import LocalLLMError
from localllm.llm import LLM


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("onload")
    src = write_arch_model(tmp / "qwen2.gguf", "qwen2", "Q8_0", n_layers=2, window=0)
    return src, export_hf(src, tmp / "hf")


def _types(path) -> set[str]:
    from gguf import GGUFReader

    return {t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1}


def test_int8_is_q8_0_blocks_and_the_same_model(hf_dir, tmp_path, monkeypatch) -> None:
    src, hf = hf_dir
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    llm = LLM(hf, quantize="int8", threads=1, ctx_size=64)
    converted = tmp_path / "converted" / llm.name
    assert converted.is_file() and llm.name.endswith("-Q8_0.gguf") and _types(converted) == {"Q8_0"}
    # Q8_0 blocks of the Q8_0 source's values: byte for byte the source, so the very same logits
    reference = LLM(src, threads=1, ctx_size=64)
    ids = list(range(3, 30))
    np.testing.assert_array_equal(score_tokens(llm.engine, ids), score_tokens(reference.engine, ids))
    stamp = converted.stat().st_mtime_ns
    assert LLM(hf, quantize="int8", threads=1, ctx_size=64).name == llm.name  # cached: not made again
    assert converted.stat().st_mtime_ns == stamp


def test_int4_and_no_quantize(hf_dir, tmp_path) -> None:
    _, hf = hf_dir
    int4 = prepare_model(str(hf), tmp_path, "int4")
    assert int4.name.endswith("-Q4_1.gguf") and "Q4_1" in _types(int4)
    f16 = prepare_model(str(hf), tmp_path)
    assert f16.name.endswith("-F16.gguf") and _types(f16) == {"F16"}
    out = LLM(str(int4), threads=1, ctx_size=64).generate("the", {"temperature": 0, "max_tokens": 4})
    assert len(out[0].token_ids) == 4


def test_bad_choices_are_refused() -> None:
    assert target_type("INT8") == "Q8_0" and target_type(None) == "F16"
    with pytest.raises(LocalLLMError, match="--group-size 64 cannot run on localllm's kernels"):
        target_type("int4", 64)
    with pytest.raises(LocalLLMError, match="--quantize must be int8 or int4"):
        target_type("int3")


def test_cli_run_quantizes_a_hugging_face_directory(hf_dir, tmp_path) -> None:
    _, hf = hf_dir
    env = {"LOCALLLM_HOME": str(tmp_path)}
    args = ["run", str(hf), "the", "--raw", "-n", "3", "--temperature", "0", "-t", "1", "-c", "64"]
    result = CliRunner().invoke(app, [*args, "--quantize", "int8"], env=env)
    assert result.exit_code == 0, result.output
    assert (
        "converting hf to Q8_0" in result.stderr and len(list((tmp_path / "converted").glob("*.gguf"))) == 1
    )
    refused = CliRunner().invoke(app, [*args, "--quantize", "int4", "--group-size", "128"], env=env)
    assert refused.exit_code != 0 and "--group-size 128 cannot run" in str(refused.exception)
