"""The families of issue 15 (Llama 3 RoPE factors, Qwen3, Gemma 2, Phi-3, YaRN) against llama.cpp.

Random-weight files of each (tests/support/tiny_arch.py VARIANTS) are written here, byte for byte the files
llama.cpp ran for tests/data/arch (fixtures/make_arch_fixtures.py). localllm, fused, must agree with
llama.cpp as closely as the calibration (localllm's float32 NumPy oracle) does, and each fixture must
discriminate: dropping the feature it exercises fails it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from arch_conformance import (
    assert_fixture_file,
    engine,
    failures,
    greedy,
    greedy_problem,
    load_fixture,
    teacher_forced,
)
from tiny_arch import VARIANTS, write_variant

from localllm.errors import ModelFormatError


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("archs")
    return {v: write_variant(d / f"{v}.gguf", v) for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_file_is_the_one_llama_cpp_ran(files, variant: str) -> None:
    assert_fixture_file(files[variant], variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_conforms_to_llama_cpp_fused(files, variant: str) -> None:
    ref = load_fixture(variant)
    e = engine(files[variant])
    assert e.backend.fused(e.model), "should run fused"
    assert failures(teacher_forced(e, ref), ref) == []
    assert greedy_problem(greedy(e, ref), ref) is None


@pytest.mark.parametrize("variant", ["phi3", "gemma2", "qwen3", "smollm3", "mistral3", "gemma4"])
def test_fused_stack_agrees_with_the_op_path(files, variant: str) -> None:
    ref = load_fixture(variant)
    fused = teacher_forced(engine(files[variant]), ref)
    ops = teacher_forced(engine(files[variant], fuse=False), ref)
    assert np.abs(fused - ops).max() / np.abs(ops).max() < 0.02
    assert (fused.argmax(-1) == ops.argmax(-1)).mean() > 0.95


def _rope(spec, **changes):
    return dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, **changes))


DROPS = {
    "llama3 rope_freqs": ("llama3", lambda s: _rope(s, factors=()), {}),
    "qwen3 q/k norm": ("qwen3", lambda s: dataclasses.replace(s, qk_norm=False), {}),
    "gemma2 attention soft-cap": ("gemma2", lambda s: dataclasses.replace(s, attn_softcap=0.0), {}),
    "gemma2 final soft-cap": ("gemma2", lambda s: s, {"final_logit_softcap": 0.0}),
    "gemma2 window": ("gemma2", lambda s: dataclasses.replace(s, window=0), {}),
    "phi3 LongRoPE factors": ("phi3", lambda s: _rope(s, factors=()), {}),
    "phi3 attn_factor": ("phi3", lambda s: _rope(s, attn_factor=1.0), {}),
    "yarn ramp": ("llama_yarn", lambda s: _rope(s, yarn_orig_ctx=0), {}),
    "smollm3 NoPE": ("smollm3", lambda s: s if s.rope.dim else _rope(s, dim=16, base=10_000.0), {}),
    "mistral3 temperature": ("mistral3", lambda s: dataclasses.replace(s, attn_temp_scale=0.0), {}),
    "mistral3 yarn log mul": ("mistral3", lambda s: _rope(s, yarn_log_mul=0.0), {}),
    "gemma4 v norm": ("gemma4", lambda s: dataclasses.replace(s, v_norm=False), {}),
    "gemma4 layer scalars": ("gemma4", lambda s: dataclasses.replace(s, out_scale=1.0), {}),
    "gemma4 proportional RoPE": ("gemma4", lambda s: _rope(s, factors=()), {}),
    "gemma4 window": ("gemma4", lambda s: dataclasses.replace(s, window=0), {}),
}


@pytest.mark.parametrize("name", list(DROPS))
def test_each_fixture_discriminates(files, name: str) -> None:
    """The same file run without one feature must fail the conformance check (op by op: the fused
    plan was built from the specs at load)."""
    variant, layer_change, model_change = DROPS[name]
    ref = load_fixture(variant)
    e = engine(files[variant], fuse=False)
    args = e.model.args
    layers = tuple(layer_change(s) for s in args.layers)
    assert layers != args.layers or model_change
    e.model.args = dataclasses.replace(args, layers=layers, **model_change)
    assert failures(teacher_forced(e, ref), ref) != []


def test_specs_read_from_the_files(files) -> None:
    llama3 = engine(files["llama3"]).args
    assert len(llama3.layers[0].rope.factors) == 8 and llama3.spec_tensors == ("rope_freqs.weight",)
    qwen3 = engine(files["qwen3"]).args
    assert qwen3.head_dim == 32 and all(s.qk_norm and s.rope.neox and not s.qkv_bias for s in qwen3.layers)
    gemma2 = engine(files["gemma2"]).args
    assert [s.window for s in gemma2.layers] == [16, 0, 16, 0]
    assert {s.attn_softcap for s in gemma2.layers} == {1.5} and gemma2.final_logit_softcap == 30.0
    assert gemma2.tied_output and gemma2.embedding_scale == pytest.approx(8.0)
    phi3 = engine(files["phi3"]).args
    assert phi3.fused_qkv and phi3.fused_gate_up and phi3.layers[0].rope.attn_factor == pytest.approx(1.19)
    yarn = engine(files["llama_yarn"]).args.layers[0].rope
    assert yarn.yarn_orig_ctx == 16 and yarn.freq_scale == 0.25
    assert yarn.mscale() == pytest.approx(1 + 0.1 * np.log(4.0))


def test_a_tensor_no_model_reads_is_refused(tmp_path) -> None:
    """A file with a tensor localllm would ignore (as Llama 3's rope_freqs once was) does not load."""
    path = write_variant(
        tmp_path / "a.gguf", "qwen3", extra={"blk.0.attn_sinks.weight": np.ones(4, np.float32)}
    )
    with pytest.raises(ModelFormatError, match="attn_sinks.weight.*does not use"):
        engine(path)


def test_phi3_long_factors_past_the_original_context(files) -> None:
    """LongRoPE as llama.cpp picks it: the short factors up to rope.scaling.original_context_length (64
    in phi3_long), the long ones past it. The phi3_long fixture (llama.cpp at 512 tokens: long) fails
    when run with the short factors."""
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.models.base import read_factors

    path = files["phi3_long"]
    e64 = LLMEngine(EngineConfig(model=str(path), backend="numpy", ctx_size=64))
    short, long = (read_factors(e64.gguf, f"rope_factors_{k}.weight") for k in ("short", "long"))
    assert short != long and e64.args.layers[0].rope.factors == short
    e = engine(path, fuse=False)
    assert e.max_model_len == 128 and all(s.rope.factors == long for s in e.args.layers)
    ref = load_fixture("phi3_long")
    assert failures(teacher_forced(e, ref), ref) == []
    e.model.args = dataclasses.replace(e.args, layers=tuple(_rope(s, factors=short) for s in e.args.layers))
    assert failures(teacher_forced(e, ref), ref) != []
