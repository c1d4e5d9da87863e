"""Gemma 4 mixture-of-experts layers (26B-A4B; tests/support/tiny_gemma4.py's gemma4_moe) against llama.cpp.

Each layer runs its dense FFN beside 8 GeGLU experts (top 2) routed on their own input, with a per-expert
down scale and the experts' gate and up fused in one tensor: localllm must agree with llama.cpp's
fixture (tests/data/arch, fixtures/make_arch_fixtures.py) as closely as its NumPy oracle does, on every
CPU backend; dropping a part must fail the check; batching must not change a sequence's tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

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
    near_tie,
    teacher_forced,
)
from engine_scenarios import alone, run_with_arrivals
from tiny_gemma4 import SHAPES, write_gemma4_variant

from localllm.errors import ModelFormatError
from localllm.sampling_params import SamplingParams

VARIANT = "gemma4_moe"


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_gemma4_variant(tmp_path_factory.mktemp("g4moe") / f"{VARIANT}.gguf", VARIANT)


def test_file_is_the_one_llama_cpp_ran(path) -> None:
    ref = assert_fixture_file(path, VARIANT)
    assert ref["calibration"]["agree_all"] >= 0.95


def test_specs_read_from_the_file(path) -> None:
    a = engine(path, "numpy").model.args
    assert [bool(s.window) for s in a.layers] == [True, False, True, False]
    assert all(s.parallel_experts and s.expert_scale and s.activation == "gelu_tanh" for s in a.layers)
    assert {(s.experts, s.experts_used, s.expert_ffn_dim, s.expert_renorm) for s in a.layers} == {
        (8, 2, 32, True)
    }
    assert a.fused_gate_up_exps and a.ffn_dim == 96


@pytest.mark.parametrize("backend", ["numba", "numpy", "torch"])
def test_conforms_to_llama_cpp(path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    ref = load_fixture(VARIANT)
    e = engine(path, backend)
    assert backend != "numba" or e.backend.fused(e.model), "should run fused"
    logits = teacher_forced(e, ref)
    assert compare(logits, ref, near_tie(ref))["figures"]["agree_all"] >= 0.95
    assert failures(logits, ref) == []
    assert greedy_problem(greedy(e, ref), ref) is None


@pytest.mark.parametrize("fuse", [True, False])
def test_numba_agrees_with_the_oracle(path, fuse: bool) -> None:
    """The fused stack and the op-by-op path against the NumPy oracle, teacher-forced."""
    ref = load_fixture(VARIANT)
    e = engine(path, fuse=fuse)
    assert e.backend.fused(e.model) == fuse
    ours, oracle = teacher_forced(e, ref), teacher_forced(engine(path, "numpy"), ref)
    assert np.abs(ours - oracle).max() / np.abs(oracle).max() < 1e-3


def test_quantized_experts_agree_with_the_oracle(tmp_path) -> None:
    """Q8_0 weights, experts included (the integer path): fused and op by op near the oracle. (8-bit
    activations may flip a near-tied expert choice, which moves that position's logits: the typical
    position is bounded, not the worst.)"""
    q8 = write_gemma4_variant(tmp_path / "q8.gguf", VARIANT, quant="Q8_0")
    ref = load_fixture(VARIANT)  # (its tokens only: llama.cpp ran the F32 file)
    oracle = teacher_forced(engine(q8, "numpy"), ref)
    fused, ops = teacher_forced(engine(q8), ref), teacher_forced(engine(q8, fuse=False), ref)
    for ours in (fused, ops):
        assert (ours.argmax(-1) == oracle.argmax(-1)).mean() >= 0.95
        assert np.median(np.abs(ours - oracle).max(-1)) / np.abs(oracle).max() < 0.01
    assert np.abs(fused - ops).max() / np.abs(ops).max() < 1e-3


@pytest.mark.parametrize("change", [{"fused_experts": False}, {"expert_ffn_per_layer": True}])
def test_other_layouts_of_the_same_numbers_run_the_same(path, tmp_path, change: dict) -> None:
    """Separate gate and up expert tensors, an expert width given per layer: the same logits."""
    other = write_gemma4_variant(
        tmp_path / "other.gguf", VARIANT, shape=dataclasses.replace(SHAPES[VARIANT], **change)
    )
    e = engine(other, "numpy")
    assert e.model.args.fused_gate_up_exps == change.get("fused_experts", True)
    ref = load_fixture(VARIANT)
    assert np.array_equal(teacher_forced(e, ref), teacher_forced(engine(path, "numpy"), ref))


def _no_expert_scale(e) -> None:
    _specs(e, expert_scale=False)


def _three_experts(e) -> None:
    _specs(e, experts_used=3)


def _router_on_the_experts_input(e) -> None:
    for lw in e.model.layers:
        lw.router_norm = lw.ffn_norm_2


def _specs(e, **change) -> None:
    a = e.model.args
    e.model.args = dataclasses.replace(a, layers=tuple(dataclasses.replace(s, **change) for s in a.layers))


@pytest.mark.parametrize("change", [_no_expert_scale, _three_experts, _router_on_the_experts_input])
def test_the_fixture_discriminates(path, change) -> None:
    """Run without a part, the same file fails the conformance check. (Renormalising the top-k weights
    cannot be told apart: post_ffw_norm_2's RMS norm cancels a per-token factor.)"""
    ref = load_fixture(VARIANT)
    e = engine(path, "numpy")
    change(e)
    assert failures(teacher_forced(e, ref), ref) != []


def test_batched_equal_each_alone(path) -> None:
    """Seeded sampling (greedy settles on one token here): each sequence's tokens are those it gets
    alone, whether prompts arrive while others run or all at once."""
    e = engine(path)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 269, int(n))] for n in rng.integers(4, 40, 6)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    expected = {i: alone(e, p, params) for i, p in enumerate(prompts)}
    assert len({tuple(v) for v in expected.values()}) > 1
    assert run_with_arrivals(e, prompts, params, seed=1) == expected
    assert {i: list(o.token_ids) for i, o in enumerate(e.generate(prompts, params))} == expected


def test_info_describes_the_file(path, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from localllm.cli import info as _info  # noqa: F401 (registers the command)
    from localllm.cli.app import app

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["info", str(path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "gemma4" in result.stdout and "active parameters" in result.stdout
    assert "experts" in result.stdout


@pytest.mark.parametrize("t", [1, 7])
def test_kernel_matches_its_twin(t: int) -> None:
    """GeGLU experts, the router on its own input and per-expert down scales through moe_ffn_ext
    (float experts: exact up to float reordering)."""
    from localllm.kernels import matmul, moe
    from localllm.kernels import moe_reference as twin

    rng = np.random.default_rng(t)
    E, k, dim, ffn = 8, 2, 64, 32
    mats = {n: (rng.standard_normal((E, r, c)) * 2 / np.sqrt(c)).astype(np.float32)
            for n, r, c in (("gate", ffn, dim), ("up", ffn, dim), ("down", dim, ffn))}  # fmt: skip
    packed = {n: [matmul.prepare_weight(m[e], 0) for e in range(E)] for n, m in mats.items()}
    router_f = rng.standard_normal((E, dim)).astype(np.float32)
    router = matmul.prepare_weight(router_f, 0)
    h, hr = rng.standard_normal((2, t, dim)).astype(np.float32)
    ds = rng.uniform(0.5, 2.0, E).astype(np.float32)
    groups = ((router,), packed["gate"], packed["up"], packed["down"])
    tables = [matmul.group_table(ws, False) for ws in groups]
    out, stats, none1, none2 = (
        np.empty_like(h),
        np.zeros(2, np.int64),
        np.empty(0, np.float32),
        np.empty((0, 0), np.float32),
    )
    moe.moe_ffn_ext(h, hr, *tables, router.gemm, False, k, True, moe.ACT_GELU, none1, none2, none2, none2, ds,
                    out, stats, 2)  # fmt: skip

    def experts(e: int) -> tuple[np.ndarray, ...]:
        return tuple(mats[n][e] for n in ("gate", "up", "down"))

    expected = twin.moe_ffn(
        h, router_f, experts, k, True, activation="gelu_tanh", router_in=hr, down_scale=ds
    )
    assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5
    routed_on_h = twin.moe_ffn(h, router_f, experts, k, True, activation="gelu_tanh", down_scale=ds)
    assert np.abs(out - routed_on_h).max() / np.abs(expected).max() > 1e-2


def _fake(meta: dict, tensors: tuple[str, ...]) -> SimpleNamespace:
    return SimpleNamespace(
        path=Path("g.gguf"), architecture="gemma4", tensors=dict.fromkeys(tensors),
        arch_get=lambda key, default=None: meta.get(key, default),
    )  # fmt: skip


def test_incomplete_expert_metadata_is_refused_by_name() -> None:
    from localllm.models import gemma4
    from localllm.models.spec import Hyper

    h = Hyper(100, 64, 2, 4, 2, 32, 96, 1e-6, 512)
    router = ("blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight")
    with pytest.raises(ModelFormatError, match="expert_feed_forward_length"):
        gemma4._moe_fields(_fake({"expert_count": 8, "expert_used_count": 2}, router), h)
    meta = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": [32, 16]}
    with pytest.raises(ModelFormatError, match="ffn_gate_up_exps"):
        gemma4._moe_fields(_fake(meta, (*router, "blk.0.ffn_gate_up_exps.weight")), h)
    fields = gemma4._moe_fields(_fake(meta, router), h)
    assert [f["expert_ffn_dim"] for f in fields] == [32, 16]
    assert gemma4._moe_fields(_fake({}, ()), h) == [{}, {}]
