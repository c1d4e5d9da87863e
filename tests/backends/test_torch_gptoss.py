"""gpt-oss on the PyTorch backend (CPU here): its attention sinks, clamped SwiGLU and biased experts
against their NumPy twins (kernels/reference.py, kernels/moe_reference.py), and both tiny gpt-oss files
(tests/support/tiny_gptoss.py) against llama.cpp's fixtures within the Numba backend's bounds
(tests/models/test_gptoss.py): the float file tightly, the MXFP4 one by top-1 agreement."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from arch_conformance import compare, engine, failures, greedy, greedy_problem, load_fixture, teacher_forced
from tiny_gptoss import GPTOSS_VARIANTS, write_gptoss_variant

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'localllm[torch]')")
import torch  # noqa: E402

from localllm.backends.torch_backend.backend import TorchBackend  # noqa: E402
from localllm.backends.torch_backend.weights import dequantize_torch, e8m0_half, upload  # noqa: E402
from localllm.engine.engine import score_tokens  # noqa: E402
from localllm.kernels import moe_reference as twin  # noqa: E402
from localllm.kernels import reference as ref  # noqa: E402
from localllm.models.layers import LayerWeights  # noqa: E402
from localllm.models.spec import LayerSpec, RopeSpec  # noqa: E402
from localllm.quant import QUANT_BY_NAME, dequantize  # noqa: E402
from localllm.quant.ggml import BLOCK_MXFP4  # noqa: E402
from localllm.quant.ggml import e8m0_half as e8m0_half_numpy  # noqa: E402

NEAR_TIE = 0.5  # ../shared/reference/README.md's margin, as tests/models/test_gptoss.py uses it
TRITON_MODULE = "localllm.backends.torch_backend.triton_quant"


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend(device="cpu")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# ---- operations against their twins -------------------------------------------------------------------


def test_swiglu_oai_matches_its_twin(backend) -> None:
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((2, 9, 300)) * 6).astype(np.float32)
    got = backend.swiglu_oai(_t(gate), _t(up)).numpy()
    np.testing.assert_allclose(got, ref.swiglu_oai(gate, up), rtol=1e-6, atol=1e-6)
    assert (gate > 7).any() and (np.abs(up) > 7).any()  # both clamps are exercised


def _cache(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k/v caches of 6 blocks of 4 (2 KV heads of 16) and 4 query heads' sinks, one dominating."""
    k, v = rng.standard_normal((2, 6, 4, 2, 16)).astype(np.float32)
    return k, v, np.array([3.0, -1.0, 0.5, 8.0], np.float32)


@pytest.mark.parametrize("window", [0, 3])
def test_sinks_match_the_twin_in_a_mixed_step(backend, window: int) -> None:
    """A step of one 5-token prefill chunk and two decodes (two attention groups), sliding or not."""
    rng = np.random.default_rng(window)
    k, v, sinks = _cache(rng)
    qsl, lens = np.array([0, 5, 6, 7]), np.array([9, 7, 3])
    tables = np.array([[2, 0, 3], [1, 4, 0], [5, 0, 0]])
    q = rng.standard_normal((7, 4, 16)).astype(np.float32)
    backend._pool_blocks = k.shape[0]
    step = SimpleNamespace(query_start_loc=qsl, context_lens=lens, block_tables=tables)
    backend._groups = backend._plan(step)
    args = (qsl, lens, tables, 0.25, window)
    got = backend.paged_attention(_t(q), _t(k), _t(v), *args, sinks=_t(sinks)).numpy()
    expected = ref.paged_attention(q, k, v, *args, sinks=sinks)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(ref.paged_attention(q, k, v, *args) - expected).max() > 0.1  # the sinks matter


def test_sinks_match_the_twin_on_the_static_stack(backend) -> None:
    """The static decode stack's attention (static.py; its padded block tables) takes the sinks too."""
    rng = np.random.default_rng(7)
    k, v, sinks = _cache(rng)
    lens, tables = np.array([9, 2]), np.array([[2, 0, 3], [1, 5, 5]])
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    backend._pool_blocks = k.shape[0]
    backend._static_batch = SimpleNamespace(block_tables=_t(tables), context_lens=_t(lens))
    try:
        got = backend.paged_attention(_t(q), _t(k), _t(v), None, None, None, 0.25, 0, sinks=_t(sinks)).numpy()
    finally:
        backend._static_batch = None
    expected = ref.paged_attention(q, k, v, np.array([0, 1, 2]), lens, tables, 0.25, sinks=sinks)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_by_hand_attention_in_query_chunks_is_the_whole(softcap: float) -> None:
    """Scores by hand (sinks, soft-cap) in chunks of queries under a small budget: the same rows as in
    one piece, down to rounding, and every chunk size's edge (one query, a ragged last chunk) covered."""
    from localllm.backends.torch_backend import attention

    rng = np.random.default_rng(3)
    s, kvh, group, nq, n_keys, dim = 2, 2, 3, 11, 40, 16
    q = _t(rng.standard_normal((s, kvh, group, nq, dim)).astype(np.float32))
    keys, values = (_t(rng.standard_normal((s, kvh, 1, n_keys, dim)).astype(np.float32)) for _ in range(2))
    q_pos = torch.arange(n_keys - nq, n_keys)[None, :].expand(s, nq)
    g = attention.Group(torch.arange(s * nq), q_pos, torch.full((s,), n_keys), torch.zeros(s, 1), n_keys)
    mask = attention.causal_mask(g, window=25)
    sinks = _t(rng.standard_normal((1, kvh, group, 1, 1)).astype(np.float32))
    whole = attention._explicit_attention(q, keys, values, mask, 0.25, softcap, sinks)
    per_query = 4 * s * kvh * group * n_keys
    for queries in (1, 4, nq - 1):
        budget = queries * per_query
        chunked = attention._explicit_attention(q, keys, values, mask, 0.25, softcap, sinks, budget)
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [1, 9])
def test_biased_moe_matches_its_twin(backend, t: int) -> None:
    """Router and expert biases and the clamped SwiGLU in moe_ffn, float experts."""
    rng = np.random.default_rng(t)
    n_exp, k, dim, ffn = 8, 4, 64, 96
    mats = {n: (rng.standard_normal((n_exp, r, c)) * 3 / np.sqrt(c)).astype(np.float32)
            for n, r, c in (("gate", ffn, dim), ("up", ffn, dim), ("down", dim, ffn))}  # fmt: skip
    router = (rng.standard_normal((n_exp, dim)) / 4).astype(np.float32)
    rb = rng.standard_normal(n_exp).astype(np.float32)
    gb, ub = (rng.standard_normal((2, n_exp, ffn)) * 0.5).astype(np.float32)
    db = (rng.standard_normal((n_exp, dim)) * 0.1).astype(np.float32)
    h = rng.standard_normal((t, dim)).astype(np.float32)
    spec = LayerSpec(rope=RopeSpec(dim=16), activation="swiglu_oai", experts=n_exp, experts_used=k,
                     expert_ffn_dim=ffn, expert_renorm=True, router_bias=True, expert_bias=True)  # fmt: skip
    lw = LayerWeights(
        attn_norm=None, ffn_norm=None, router=_t(router), router_b=_t(rb),
        gate_exps=tuple(_t(mats["gate"])), up_exps=tuple(_t(mats["up"])), down_exps=tuple(_t(mats["down"])),
        gate_exps_b=_t(gb), up_exps_b=_t(ub), down_exps_b=_t(db),
    )  # fmt: skip
    got = backend.moe_ffn(_t(h), lw, spec).numpy()
    expected = twin.moe_ffn(h, router, lambda e: tuple(mats[n][e] for n in ("gate", "up", "down")), k, True,
                            lambda e: (gb[e], ub[e], db[e]), rb, "swiglu_oai")  # fmt: skip
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5
    plain = backend.moe_ffn(_t(h), lw, dataclasses.replace(spec, router_bias=False, expert_bias=False))
    assert np.abs(plain.numpy() - expected).max() / np.abs(expected).max() > 0.05  # the biases matter


# ---- MXFP4 kept quantized ------------------------------------------------------------------------------


def test_mxfp4_dequantizes_like_numpy_at_every_exponent() -> None:
    """weights.py's torch dequantizer, bit for bit, over every E8M0 byte (subnormal 0 and 1, and 255,
    whose doubled codes overflow to infinity as NumPy's do) and every E2M1 code."""
    e = np.arange(256, dtype=np.uint8)
    same = e8m0_half(torch.from_numpy(e)).numpy().view(np.uint32) == e8m0_half_numpy(e).view(np.uint32)
    assert same.all()
    rng = np.random.default_rng(0)
    blocks = np.zeros((4, 64), BLOCK_MXFP4)  # 4 rows of 64 blocks: each exponent once
    blocks["e"] = e.reshape(4, 64)
    blocks["qs"] = rng.integers(0, 256, size=(4, 64, 16))
    raw = blocks.view(np.uint8).reshape(4, -1)
    ggml_type = QUANT_BY_NAME["MXFP4"].ggml_type
    got = dequantize_torch(upload(raw, ggml_type, torch.device("cpu"))).numpy()
    with np.errstate(over="ignore"):  # e = 255 times 12: infinity, on both sides
        expected = dequantize(raw, ggml_type)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def _quantized_engine(path, monkeypatch, device: str = "cpu"):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    monkeypatch.setenv("LOCALLLM_TORCH_WEIGHTS", "quantized")
    e = LLMEngine(EngineConfig(model=str(path), backend="torch", device=device, threads=2, ctx_size=128))
    assert e.backend.weights == "quantized"
    assert {"MXFP4", "Q8_0"} <= set(e.backend.memory.by_kind), e.backend.memory.by_kind  # no dense experts
    return e


def test_mxfp4_experts_stay_quantized_through_torch_ops(files, monkeypatch) -> None:
    """The path without Triton (MPS; here the CPU): the experts held as MXFP4 blocks, dequantized a
    chunk at a time, give the NumPy oracle's logits to float rounding."""
    e = _quantized_engine(files["gptoss"], monkeypatch)
    assert e.backend.qlinear.kernels == "torch"
    tokens = load_fixture("gptoss")["prompt"][:24]
    expected = score_tokens(engine(files["gptoss"], "numpy"), tokens)
    got = score_tokens(e, tokens)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.fixture(scope="module")
def tq():
    """The kernel module: compiled on a GPU, else run by Triton's interpreter (as test_torch_quant.py)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if not torch.cuda.is_available():
        if TRITON_MODULE in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernels were already defined for a GPU in this process")
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(TRITON_MODULE)


def test_mxfp4_experts_through_the_triton_kernels(tq, files, monkeypatch) -> None:
    """Every matmul through the Triton kernels (the interpreter here, CPU tensors; on a GPU the
    device's): an 8-token prefill by the GEMM and the decode's 1-3 routed tokens per expert by the
    GEMV, the oracle's logits to float rounding."""
    e = _quantized_engine(files["gptoss"], monkeypatch, "cuda" if torch.cuda.is_available() else "cpu")
    e.backend.qlinear.kernels, e.backend.qlinear.precision = "triton", "ieee"
    tokens = load_fixture("gptoss")["prompt"][:8]
    expected = score_tokens(engine(files["gptoss"], "numpy"), tokens)
    got = score_tokens(e, tokens)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-4


# ---- the tiny gpt-oss files against llama.cpp -------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("torch-gptoss")
    return {v: write_gptoss_variant(d / f"{v}.gguf", v) for v in GPTOSS_VARIANTS}


@pytest.fixture(scope="module")
def float_engine(files):
    return engine(files["gptoss_f32"], "torch")


@pytest.mark.parametrize("variant", list(GPTOSS_VARIANTS))
def test_torch_backend_conforms(files, float_engine, variant: str) -> None:
    """gptoss_f32: every logit within the calibrated bounds, greedy equal up to a near-tie. gptoss
    (MXFP4 experts, dequantized to float32 on the CPU; Q8_0 elsewhere): llama.cpp rounds its
    activations to 8 bits and this backend does not, so top-1 agreement, as the Numba backend's test."""
    fixture = load_fixture(variant)
    if variant == "gptoss_f32":
        assert failures(teacher_forced(float_engine, fixture), fixture) == []
        assert greedy_problem(greedy(float_engine, fixture), fixture) is None
        return
    e = engine(files[variant], "torch")
    figures = compare(teacher_forced(e, fixture), fixture, NEAR_TIE)["figures"]
    assert figures["agree_all"] >= 0.95, figures
    assert figures["top8_shared"] >= 7, figures
    for g, (a, b) in enumerate(zip(greedy(e, fixture), fixture["greedy"], strict=False)):
        if fixture["greedy_margin"][g] < NEAR_TIE:
            break
        assert a == b, f"greedy step {g}: {a} != {b} (llama.cpp's margin {fixture['greedy_margin'][g]:.2f})"


DROPS = {
    "no attention sinks": {"attn_sinks": False},
    "no router bias": {"router_bias": False},
    "no expert biases": {"expert_bias": False},
    "plain SwiGLU": {"activation": "silu"},
}


@pytest.mark.parametrize("name", list(DROPS))
def test_each_gptoss_feature_matters(float_engine, name: str) -> None:
    """The float file with one of the features this backend had to learn switched off fails."""
    fixture = load_fixture("gptoss_f32")
    args = float_engine.model.args
    float_engine.model.args = dataclasses.replace(
        args, layers=tuple(dataclasses.replace(s, **DROPS[name]) for s in args.layers)
    )
    try:
        assert failures(teacher_forced(float_engine, fixture), fixture) != []
    finally:
        float_engine.model.args = args
