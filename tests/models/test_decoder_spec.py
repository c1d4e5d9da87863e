"""One decoder, declared once: every architecture's LayerSpec runs the same on the fused Numba stack,
the op-by-op path and the NumPy oracle, and its windows, biases, norms and rotations take effect."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_arch import ARCHS, write_arch_model

from localllm.backends import numba_stack
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.models.spec import LayerSpec, RopeSpec, spec_fields

PROMPT = list(range(5, 53))  # 48 tokens: three times the 16-token windows


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("arch")
    out = {
        (a, q): write_arch_model(d / f"{a}-{q}.gguf", a, q) for a in ARCHS for q in ("F32", "Q8_0", "Q5_0")
    }
    out["llama", "nowindow"] = write_arch_model(d / "llama-nowindow.gguf", "llama", "Q8_0", window=0)
    return out


def _engine(path, backend: str = "numba") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), backend=backend, threads=2, ctx_size=128))


def _both_paths(path) -> tuple[np.ndarray, np.ndarray]:
    engine = _engine(path)
    logits = {}
    for fuse in (True, False):
        engine.backend.fuse_layers = fuse
        logits[fuse] = np.asarray(score_tokens(engine, PROMPT))
    engine.backend.fuse_layers = True
    assert engine.backend.fused(engine.model), "should run fused"
    return logits[True], logits[False]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_stack_runs_every_architecture_like_the_op_path(arch_models, arch: str) -> None:
    """Same kernels in the same order, over a prompt three windows long, with float weights (no 8-bit
    activation rounding whose flips chaotic layers would amplify). Not the same bits: the stack runs its
    own compiled copies of the kernels (kernels/local_callees.py), and LLVM may vectorise their fastmath
    sums another way. llama and qwen2 agree exactly; gemma3's attention sums differ from the second
    position on (position 0, one key, agrees), up to 3-5e-5 of the largest logit by the 48th."""
    fused, ops = _both_paths(arch_models[arch, "F32"])
    assert rel_err(fused, ops) < 1e-4


@pytest.mark.parametrize("quant", ["Q8_0", "Q5_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_stack_quantized_paths_agree(arch_models, arch: str, quant: str) -> None:
    """Quantized weights take the integer kernels (and gemma3's near-float down projection: int16
    activations for Q8_0, two 8-bit passes otherwise). A one-ulp difference can flip an activation's
    8-bit rounding, which later layers amplify, so the bound is the int8 error, not rounding."""
    fused, ops = _both_paths(arch_models[arch, quant])
    assert rel_err(fused, ops) < 0.02
    assert (fused.argmax(-1) == ops.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_numba_backend_matches_the_numpy_oracle(arch_models, arch: str) -> None:
    """The fused stack against float32 NumPy: to float rounding with float weights (a precise
    projection on the float path once counted its input twice; f16 KV rounds a 1-ulp difference to
    1e-3 of an element now and then), within int8 activation rounding
    with quantized ones."""
    for quant, bound in (("F32", 1e-4), ("Q8_0", 0.05)):
        ours = np.asarray(score_tokens(_engine(arch_models[arch, quant]), PROMPT))
        oracle = np.asarray(score_tokens(_engine(arch_models[arch, quant], "numpy"), PROMPT))
        assert rel_err(ours, oracle) < bound, quant
        assert (ours.argmax(-1) == oracle.argmax(-1)).mean() > 0.9


def test_sliding_window_changes_only_positions_past_it(arch_models) -> None:
    """A llama file with a 16-token window: the first 16 positions equal the windowless model's,
    later ones differ (the trap of a fused stack that ignored the window)."""
    windowed = np.asarray(score_tokens(_engine(arch_models["llama", "Q8_0"]), PROMPT))
    full = np.asarray(score_tokens(_engine(arch_models["llama", "nowindow"]), PROMPT))
    np.testing.assert_array_equal(windowed[:16], full[:16])
    assert np.abs(windowed[16:] - full[16:]).max(axis=1).min() > 1e-4


def test_architectures_are_read_into_specs(arch_models) -> None:
    llama = _engine(arch_models["llama", "Q8_0"]).args
    assert {s.window for s in llama.layers} == {16} and llama.layers[0].rope.freq_scale == 0.5
    assert not llama.layers[0].qkv_bias and llama.layers[0].activation == "silu"
    qwen = _engine(arch_models["qwen2", "Q8_0"]).args
    assert all(s.qkv_bias and s.rope.neox for s in qwen.layers)
    gemma = _engine(arch_models["gemma3", "Q8_0"]).args
    assert [s.window for s in gemma.layers] == [16] * 5 + [0]
    assert [s.rope.base for s in gemma.layers] == [10_000.0] * 5 + [1_000_000.0]
    assert all(s.qk_norm and s.post_attn_norm and s.post_ffn_norm and s.precise_down for s in gemma.layers)
    assert gemma.embedding_scale == pytest.approx(8.0) and gemma.tied_output


def test_every_spec_field_is_executed_by_the_fused_stack() -> None:
    """Adding a LayerSpec field without teaching kernels/decoder.py fails here first."""
    assert set(spec_fields(LayerSpec(RopeSpec(dim=8)))) <= numba_stack.EXECUTED


def test_fused_stack_refuses_a_field_it_does_not_execute_by_name(monkeypatch) -> None:
    monkeypatch.setattr(numba_stack, "EXECUTED", numba_stack.EXECUTED - {"attn_softcap"})
    plain = LayerSpec(RopeSpec(dim=8))
    assert numba_stack.refusal((plain, plain)) is None
    capped = dataclasses.replace(plain, attn_softcap=50.0)
    assert "layer 1: LayerSpec.attn_softcap = 50.0" in numba_stack.refusal((plain, capped))


def test_two_pass_down_tables_take_exact_sums() -> None:
    """A two-pass down projection over Q4_1 / Q5_1 weights rounds as Q8_0 (exact block sums: its residual
    pass cannot see Q8_1's float16 ones); other layers keep their weights' rounding."""
    from localllm.kernels import decoder as dk
    from localllm.kernels import matmul

    down = np.zeros((3, 1, matmul.TABLE_LEN), np.int64)
    down[:, 0, matmul.T_ROUND] = [matmul.ROUND_Q8_1, matmul.ROUND_Q8_1, matmul.ROUND_Q8_K]
    flags = np.zeros((3, dk.N_FLAGS), np.int64)
    flags[[0, 2], dk.F_DOWN] = dk.DOWN_TWO_PASS
    rounds = numba_stack._precise_down(down, flags)[:, 0, matmul.T_ROUND]
    assert rounds.tolist() == [matmul.ROUND_Q8_0, matmul.ROUND_Q8_1, matmul.ROUND_Q8_K]
