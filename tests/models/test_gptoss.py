"""gpt-oss (issue 30): random-weight files (tests/support/tiny_gptoss.py) against llama.cpp b11312's logits in
tests/data/arch (fixtures/make_arch_fixtures.py), and its new kernels against their NumPy twins.

`gptoss_f32` is all float32 (llama.cpp then rounds no activations): every spec field is compared
tightly, and the file with any one of them changed fails.  `gptoss` has MXFP4 experts and Q8_0
elsewhere (llama-quantize's MXFP4_MOE), where both engines round activations to 8 bits: teacher-forced
top-1 agreement of at least 95%, free-running greedy equal up to llama.cpp's first margin under 0.5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from arch_conformance import (
    assert_fixture_file,
    compare,
    engine,
    failures,
    greedy,
    greedy_problem,
    load_fixture,
    teacher_forced,
)
from tiny_gptoss import GPTOSS_VARIANTS, write_gptoss_variant

from localllm.kernels import attention, layers, matmul, moe
from localllm.kernels import moe_reference as twin
from localllm.kernels import reference as ref

NEAR_TIE = 0.5  # ../shared/reference/README.md's margin for real models


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("gptoss")
    return {v: write_gptoss_variant(d / f"{v}.gguf", v) for v in GPTOSS_VARIANTS}


@pytest.mark.parametrize("variant", list(GPTOSS_VARIANTS))
def test_file_is_the_one_llama_cpp_ran(files, variant: str) -> None:
    assert_fixture_file(files[variant], variant)


def test_specs_read_from_the_file(files) -> None:
    args = engine(files["gptoss"]).args
    even, odd = args.layers[0], args.layers[1]
    assert (even.window, odd.window) == (16, 0) and args.layers[2].window == 16
    assert (
        even.activation == "swiglu_oai" and even.expert_renorm and (even.experts, even.experts_used) == (8, 4)
    )
    assert even.attn_sinks and even.o_bias and even.qkv_bias and even.router_bias and even.expert_bias
    assert even.rope.neox and even.rope.yarn_orig_ctx == 64 and even.rope.freq_scale == 1 / 32
    assert (args.head_dim, args.n_heads, args.n_kv_heads) == (32, 8, 2)


def test_float_file_conforms_fused_and_op_by_op(files) -> None:
    fixture = load_fixture("gptoss_f32")
    e = engine(files["gptoss_f32"])
    assert e.backend.fused(e.model), "should run fused"
    fused = teacher_forced(e, fixture)
    assert failures(fused, fixture) == []
    assert greedy_problem(greedy(e, fixture), fixture) is None
    e.backend.fuse_layers = False
    ops = teacher_forced(e, fixture)
    assert failures(ops, fixture) == []
    assert np.abs(fused - ops).max() / np.abs(ops).max() < 1e-4


def _first_greedy_problem(ours: list[int], fixture: dict) -> str | None:
    for g, (a, b) in enumerate(zip(ours, fixture["greedy"], strict=False)):
        if fixture["greedy_margin"][g] < NEAR_TIE:
            return None
        if a != b:
            return f"greedy step {g}: {a} != {b} (llama.cpp's margin {fixture['greedy_margin'][g]:.2f})"
    return None


@pytest.mark.parametrize("fuse", [True, False])
def test_mxfp4_file_conforms(files, fuse: bool) -> None:
    fixture = load_fixture("gptoss")
    e = engine(files["gptoss"], fuse=fuse)
    figures = compare(teacher_forced(e, fixture), fixture, NEAR_TIE)["figures"]
    assert figures["agree_all"] >= 0.95, figures
    assert figures["top8_shared"] >= 7, figures
    assert _first_greedy_problem(greedy(e, fixture), fixture) is None


def _each(**change):
    return lambda s: dataclasses.replace(s, **change)


DROPS = {
    "no attention sinks": _each(attn_sinks=False),
    "no output bias": _each(o_bias=False),
    "no router bias": _each(router_bias=False),
    "no expert biases": _each(expert_bias=False),
    "plain SwiGLU": _each(activation="silu"),
    "no sliding window": _each(window=0),
    "no YaRN": lambda s: dataclasses.replace(
        s, rope=dataclasses.replace(s.rope, yarn_orig_ctx=0, freq_scale=1.0)
    ),
    "top-2": _each(experts_used=2),
}


@pytest.mark.parametrize("name", list(DROPS))
def test_each_field_matters(files, name: str) -> None:
    """The float file run with one spec field changed fails the conformance check (fused stack)."""
    fixture = load_fixture("gptoss_f32")
    e = engine(files["gptoss_f32"])
    e.model.args = dataclasses.replace(
        e.model.args, layers=tuple(DROPS[name](s) for s in e.model.args.layers)
    )
    e.backend._plans.clear()  # the fused stack's plan is built from the specs: rebuild it
    assert failures(teacher_forced(e, fixture), fixture) != []


# ---- kernels against their twins ----------------------------------------------------------------


def test_swiglu_oai_matches_its_twin() -> None:
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((2, 7, 300)) * 6).astype(np.float32)
    out = np.empty_like(gate)
    layers.swiglu_oai_rows(gate, up, out)
    expected = ref.swiglu_oai(gate, up)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert (gate > 7).any() and (np.abs(up) > 7).any()  # both clamps are exercised


@pytest.mark.parametrize("t,window", [(1, 0), (6, 0), (6, 3)])
def test_attention_sinks_match_their_twin(t: int, window: int) -> None:
    rng = np.random.default_rng(t + window)
    heads, kv_heads, d, bs, ctx = 4, 2, 16, 4, 9
    k_cache = rng.standard_normal((4, bs, kv_heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((4, bs, kv_heads, d)).astype(np.float32)
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    sinks = np.array([3.0, -1.0, 0.5, 8.0], np.float32)  # one dominating every score
    tables, qsl, lens = np.array([[2, 0, 3]], np.int64), np.array([0, t], np.int64), np.array([ctx], np.int64)
    out = np.empty_like(q)
    attention.paged_attention_sinks_serial(
        q, k_cache, v_cache, qsl, lens, tables, 0.25, window, 0.0, sinks, out
    )
    expected = ref.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.25, window, sinks=sinks)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    plain = ref.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.25, window)
    assert np.abs(plain - expected).max() > 0.1


@pytest.mark.parametrize("t", [1, 9])
def test_biased_moe_matches_its_twin(t: int) -> None:
    """Router and expert biases and the clamped SwiGLU, float experts (exact) through moe_ffn_ext."""
    rng = np.random.default_rng(t)
    E, k, dim, ffn = 8, 4, 64, 96
    mats = {n: (rng.standard_normal((E, r, c)) * 3 / np.sqrt(c)).astype(np.float32)
            for n, r, c in (("gate", ffn, dim), ("up", ffn, dim), ("down", dim, ffn))}  # fmt: skip
    packed = {n: [matmul.prepare_weight(m[e], 0) for e in range(E)] for n, m in mats.items()}
    router_f = (rng.standard_normal((E, dim)) / 4).astype(np.float32)
    router = matmul.prepare_weight(router_f, 0)
    rb = rng.standard_normal(E).astype(np.float32)
    gb, ub = (rng.standard_normal((2, E, ffn)) * 0.5).astype(np.float32)
    db = (rng.standard_normal((E, dim)) * 0.1).astype(np.float32)
    h = rng.standard_normal((t, dim)).astype(np.float32)
    tables = [
        matmul.group_table(ws, False) for ws in ((router,), packed["gate"], packed["up"], packed["down"])
    ]
    out, stats = np.empty_like(h), np.zeros(2, np.int64)
    none = np.empty(0, np.float32)
    oai = moe.ACT_OAI
    moe.moe_ffn_ext(h, h, *tables, router.gemm, False, k, True, oai, rb, gb, ub, db, none, out, stats, 2)
    expected = twin.moe_ffn(h, router_f, lambda e: tuple(mats[n][e] for n in ("gate", "up", "down")), k, True,
                            lambda e: (gb[e], ub[e], db[e]), rb, "swiglu_oai")  # fmt: skip
    assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5
