"""A first run compiles the model's kernels while the model downloads (localllm/prewarm.py)."""

from __future__ import annotations

import pytest

from localllm.errors import ConfigError
from localllm.model_entry import TensorTypes
from localllm.prewarm import KernelPrewarm, tensor_types, write_synthetic_model
from localllm.registry import load_registry, parse_registry


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", TensorTypes("Q4_1", ("Q4_1",))),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", TensorTypes("Q4_K", ("Q4_K", "Q6_K"), "Q6_K")),
        ("llama-3.2-1b-instruct-Q8_0.gguf", TensorTypes("Q8_0", ("Q8_0",))),
        ("model-f16.gguf", TensorTypes("F16", ("F16",))),
        ("model.gguf", None),
        ("model.IQ4_XS.gguf", None),  # not a type we compile ahead
        ("mistral-7b.Q3_K_M.gguf", None),  # Q3_K runs on the float path; nothing to write ahead
    ],
)
def test_types_guessed_from_a_file_name(name: str, expected: TensorTypes | None) -> None:
    assert tensor_types(None, name) == expected


def test_a_registry_entry_states_its_types() -> None:
    entry = load_registry(None).find("qwen2.5-coder-0.5b-instruct")
    assert entry.tensor_types == TensorTypes("Q5_0", ("Q5_0", "Q8_0", "Q4_K", "Q6_K"), "Q8_0")
    assert tensor_types(entry, entry.file_name) is entry.tensor_types


@pytest.mark.parametrize(
    "value",
    ['"Q4_1"', '{ token_embd = "Q8_0" }', '{ token_embd = "Q8_0", layers = [] }',
     '{ token_embd = "Q9_9", layers = ["Q4_1"] }', '{ token_embd = "Q8_0", layers = ["Q4_1"], x = 1 }'],
)  # fmt: skip
def test_bad_tensor_types_are_refused_in_one_line(value: str) -> None:
    text = f'[models.m]\nsource = "https://example.com/m.gguf"\ntensor_types = {value}\n'
    with pytest.raises(ConfigError, match=r"models\.m\.tensor_types in models\.toml must be"):
        parse_registry(text)


def test_the_synthetic_model_holds_every_type_in_its_role(tmp_path) -> None:
    from localllm import quant
    from localllm.loading.file import GGUFFile

    types = TensorTypes("Q5_0", ("Q5_0", "Q8_0", "Q4_K", "Q6_K"), "Q8_0")
    gf = GGUFFile.open(write_synthetic_model(tmp_path / "m.gguf", types))
    names = {name: quant.type_name(t.ggml_type) for name, t in gf.tensors.items()}
    assert names["token_embd.weight"] == "Q5_0" and names["output.weight"] == "Q8_0"
    layer_types = {t for name, t in names.items() if name.startswith("blk.") and "norm" not in name}
    assert layer_types == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_prewarm_loads_the_synthetic_model_on_the_numba_backend() -> None:
    # With the suite's kernel cache warm this loads rather than compiles: it proves the thread runs the
    # real load path to the end (a failure there would leave `seconds` None).
    seconds = KernelPrewarm(TensorTypes("Q8_0", ("Q4_1",)), 1, ("f16", "f16")).start().join()
    assert seconds is not None and seconds > 0


def test_no_prewarm_when_the_model_is_already_there(tmp_path, monkeypatch) -> None:
    from localllm.cli import common

    monkeypatch.setattr(common, "kernels_compiled", lambda: False)
    models = tmp_path / "models"
    models.mkdir()
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    assert common._start_prewarm("smollm2-135m-instruct", tmp_path, 1, ("f16", "f16")) is None
    assert common._start_prewarm("/some/file.gguf", tmp_path, 1, ("f16", "f16")) is None
    monkeypatch.setattr(common, "kernels_compiled", lambda: True)
    assert common._start_prewarm("gemma-3-270m", tmp_path, 1, ("f16", "f16")) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "fixture", ["smollm2_path", "gemma3_path", "qwen25c_path"]
)  # the registry's tensor_types say what the files really hold
def test_registry_tensor_types_match_the_files(fixture: str, request) -> None:
    from localllm import quant
    from localllm.loading.file import GGUFFile

    path = request.getfixturevalue(fixture)
    entry = next(e for e in load_registry(None).entries.values() if e.file_name == path.name)
    gf = GGUFFile.open(path)
    kinds = {name: quant.type_name(t.ggml_type) for name, t in gf.tensors.items()}
    layers = {t for name, t in kinds.items() if name.startswith("blk.") and t not in ("F32",)}
    assert kinds["token_embd.weight"] == entry.tensor_types.token_embd
    assert kinds.get("output.weight") == entry.tensor_types.output
    assert layers == set(entry.tensor_types.layers)
