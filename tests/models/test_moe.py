"""Mixture-of-experts layers (issue 15): qwen3moe, qwen2moe (shared expert) and Mixtral-style llama.

The kernels (kernels/moe.py) against their NumPy twins (kernels/moe_reference.py); random-weight files
(tests/support/tiny_moe.py) against llama.cpp's logits in tests/data/arch (fixtures/make_arch_fixtures.py),
calibrated by the NumPy oracle like tests/models/test_architectures.py; each fixture discriminates (running
it without routing renormalisation, or without the shared expert, fails it); and a decode token reads
only the routed experts' bytes.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from arch_conformance import (
    assert_fixture_file,
    engine,
    failures,
    greedy,
    greedy_problem,
    load_fixture,
    routing_near_tie,
    teacher_forced,
)
from gguf.quants import quantize
from tiny_moe import MOE_VARIANTS, N_EXPERTS, N_USED, write_moe_variant

from localllm.kernels import matmul, moe
from localllm.kernels import moe_reference as twin
from localllm.quant import dequantize

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("moe")
    return {v: write_moe_variant(d / f"{v}.gguf", v) for v in MOE_VARIANTS}


# ---- kernels against their twins ----------------------------------------------------------------


@pytest.mark.parametrize("renorm", [True, False])
def test_route_matches_its_twin(renorm: bool) -> None:
    logits = np.random.default_rng(3).standard_normal((37, 8)).astype(np.float32) * 2
    logits[0, 5] = logits[0, 2]  # a tie: the lower index first, in both
    ids, w = np.empty((37, 3), np.int64), np.empty((37, 3), np.float32)
    moe.route(logits, 3, renorm, ids, w)
    ids_ref, w_ref = twin.route(logits, 3, renorm)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5)
    assert np.allclose(w.sum(1), 1.0) == renorm


def test_group_by_expert_orders_rows_by_expert_then_token() -> None:
    ids = np.random.default_rng(4).integers(0, 6, (11, 2)).astype(np.int64)
    ids[:, 1] = (ids[:, 0] + 1) % 6  # a token picks two different experts
    starts, order, slot = moe.group_by_expert(ids, 6)
    flat = np.argsort(ids.ravel(), kind="stable")
    np.testing.assert_array_equal(order, flat // 2)
    np.testing.assert_array_equal(starts, np.searchsorted(np.sort(ids.ravel()), np.arange(7)))
    for t in range(11):
        for j in range(2):
            r = slot[t, j]
            assert order[r] == t and starts[ids[t, j]] <= r < starts[ids[t, j] + 1]


def _experts(rng, name: str, rows: int, cols: int) -> tuple[list, list]:
    """(packed matrices, float matrices) of N_EXPERTS random experts of one ggml type."""
    data = (rng.standard_normal((N_EXPERTS, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    raw = data if name == "F32" else quantize(data, T[name])
    packed = [matmul.prepare_weight(raw[e], T[name]) for e in range(N_EXPERTS)]
    return packed, [dequantize(raw[e], T[name]) for e in range(N_EXPERTS)]


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_0", "Q4_0 float path"])
@pytest.mark.parametrize("t", [1, 9])
def test_moe_ffn_matches_its_twin(name: str, t: int) -> None:
    """Decode (one token) and a prefill whose tokens group by expert: the routed experts only, on the
    integer path (8-bit activations) for quantized experts, the float path for F32 (and for quantized
    experts on long prompts without AVX2)."""
    name, use_int = name.split()[0], not name.endswith("float path") and name != "F32"
    rng = np.random.default_rng(t)
    dim, ffn = 64, 96
    gate, gate_f = _experts(rng, name, ffn, dim)
    up, up_f = _experts(rng, name, ffn, dim)
    down, down_f = _experts(rng, name, dim, ffn)
    router_f = rng.standard_normal((N_EXPERTS, dim)).astype(np.float32) / 4
    router = matmul.prepare_weight(router_f, T.F32)
    h = rng.standard_normal((t, dim)).astype(np.float32)
    tables = [matmul.group_table(ws, use_int) for ws in ((router,), gate, up, down)]
    out, stats = np.empty_like(h), np.zeros(2, np.int64)
    moe.moe_ffn(h, *tables, router.gemm, use_int, N_USED, True, out, stats, 2)
    expected = twin.moe_ffn(h, router_f, lambda e: (gate_f[e], up_f[e], down_f[e]), N_USED, True)
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < (0.03 if use_int else 1e-5)
    ids, _ = twin.route(h @ router_f.T, N_USED, True)
    per_expert = gate[0].nbytes + up[0].nbytes + down[0].nbytes
    assert stats[moe.STAT_BYTES] == len(np.unique(ids)) * per_expert and stats[moe.STAT_ROWS] == t


def test_sigmoid_gate_matches_its_twin() -> None:
    rng = np.random.default_rng(6)
    h, weight = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    out = np.empty(5, np.float32)
    moe.sigmoid_gate(h, weight, out)
    np.testing.assert_allclose(out[:, None], twin.sigmoid_gate(h, weight), rtol=1e-5)


def test_launch_segments_equals_linear_on_each_segment() -> None:
    rng = np.random.default_rng(5)
    packed, _ = _experts(rng, "Q8_0", 70, 64)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    table = matmul.group_table([packed[1], packed[6]], True)
    y = np.zeros((9, 140), np.float32)
    moe.launch_segments(table, np.array([[0, 4], [4, 9]]), np.array([0, 70]), 0, True, x, y, 2)
    np.testing.assert_array_equal(y[:4, :70], matmul.linear(x[:4], packed[1], 2))
    np.testing.assert_array_equal(y[4:, 70:], matmul.linear(x[4:], packed[6], 2))
    assert not y[:4, 70:].any() and not y[4:, :70].any()


# ---- the files against llama.cpp ------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_file_is_the_one_llama_cpp_ran(files, variant: str) -> None:
    assert_fixture_file(files[variant], variant)


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_conforms_to_llama_cpp_fused(files, variant: str) -> None:
    ref = load_fixture(variant)
    e = engine(files[variant])
    assert e.backend.fused(e.model), "should run fused"
    assert failures(teacher_forced(e, ref), ref, routing_near_tie(files[variant], ref)) == []
    assert greedy_problem(greedy(e, ref), ref) is None


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_op_path_conforms_and_agrees_with_the_fused_stack(files, variant: str) -> None:
    ref = load_fixture(variant)
    e = engine(files[variant])
    fused = teacher_forced(e, ref)
    e.backend.fuse_layers = False
    ops = teacher_forced(e, ref)
    assert failures(ops, ref, routing_near_tie(files[variant], ref)) == []
    # float experts: the same kernels in the same order (no 8-bit rounding whose flips layers amplify)
    bound = 1e-5 if MOE_VARIANTS[variant][1] == "F32" else 0.02
    assert np.abs(fused - ops).max() / np.abs(ops).max() < bound


def _layers(**change):
    return lambda s: dataclasses.replace(s, **change)


DROPS = {
    # (qwen3moe's last position routes on a near-tie, which leaves only its RMS to tell renormalisation;
    # the Q4_0 file, the same architecture, shows it at other positions)
    "qwen3moe Q4_0 renormalisation": ("qwen3moe_q4", _layers(expert_renorm=False)),
    "mixtral renormalisation": ("mixtral", _layers(expert_renorm=False)),
    "qwen2moe shared expert": ("qwen2moe", _layers(shared_expert=False)),
    "qwen2moe renormalised (it is not)": ("qwen2moe", _layers(expert_renorm=True)),
    "qwen3moe top-1": ("qwen3moe", _layers(experts_used=1)),
}


@pytest.mark.parametrize("name", list(DROPS))
def test_each_fixture_discriminates(files, name: str) -> None:
    """The same file with one routing choice changed fails the conformance check (op by op), under the
    same rules (a routing near-tie at the last position lifts its RMS bound there too)."""
    variant, change = DROPS[name]
    ref = load_fixture(variant)
    e = engine(files[variant], fuse=False)
    e.model.args = dataclasses.replace(e.model.args, layers=tuple(change(s) for s in e.model.args.layers))
    assert failures(teacher_forced(e, ref), ref, routing_near_tie(files[variant], ref)) != []


def test_specs_read_from_the_files(files) -> None:
    q3 = engine(files["qwen3moe"]).args.layers[0]
    assert (q3.experts, q3.experts_used, q3.expert_ffn_dim, q3.expert_renorm) == (8, 2, 64, True)
    assert q3.qk_norm and not q3.shared_expert and not q3.dense_ffn
    q2 = engine(files["qwen2moe"]).args
    assert q2.ffn_dim == 96 and q2.layers[0].shared_expert and not q2.layers[0].expert_renorm
    mx = engine(files["mixtral"]).args.layers[0]
    assert mx.expert_renorm and mx.expert_ffn_dim == 64 and not mx.rope.neox


# ---- bytes read per token ---------------------------------------------------------------------------


def expert_bytes(model) -> int:
    return sum(w.nbytes for lw in model.layers for ws in (lw.gate_exps, lw.up_exps, lw.down_exps) for w in ws)


@pytest.mark.parametrize("fuse", [True, False])
def test_a_decode_token_reads_only_its_routed_experts(files, fuse: bool) -> None:
    """Top-2 of 8: a decode token launches exactly 2/8 of every layer's expert bytes (the kernels
    see only those buffers); a prefill launches each routed expert once for all its tokens."""
    from localllm.sampling_params import SamplingParams

    e = engine(files["qwen3moe"], fuse=fuse)
    stats = e.backend._plan(e.model).moe_stats if fuse else e.backend.moe_stats
    total, n_layers = expert_bytes(e.model), e.model.args.n_layers
    e.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for step in range(3):
        before = stats.copy()
        e.step()
        launched, rows = stats - before
        assert rows == (20 if step == 0 else 1) * n_layers
        assert launched <= total
        if step:
            assert launched / total == pytest.approx(N_USED / N_EXPERTS) and launched / total <= 0.35


def test_info_shows_experts_and_active_parameters(files, tmp_path) -> None:
    from localllm.loading.file import GGUFFile
    from localllm.model_info import summarize

    gf = GGUFFile.open(files["qwen3moe"], tmp_path)
    info = summarize(gf)
    routed = sum(int(np.prod(t.shape)) for t in gf.tensors.values() if "_exps." in t.name)
    active = info.parameters - routed + routed * N_USED // N_EXPERTS
    assert (info.extra["experts"], info.extra["experts per token"]) == (N_EXPERTS, N_USED)
    assert info.extra["active parameters"].endswith(f"({active:,}) per token")


def test_refusals_are_one_line(files, tmp_path) -> None:
    """More experts used than there are, and a backend without the MoE layer, are refused by name."""
    from localllm.backends.numpy_ref import NumpyBackend
    from localllm.errors import ModelFormatError
    from localllm.loading.file import GGUFFile
    from localllm.models import load_model

    gf = GGUFFile.open(files["qwen3moe"], tmp_path)
    gf.metadata["qwen3moe.expert_used_count"] = 9
    with pytest.raises(ModelFormatError, match="expert_used_count' is 9; expected 1 to 8"):
        load_model(gf, NumpyBackend())

    class NoMoe(NumpyBackend):
        name, runs_moe = "plain", False

    with pytest.raises(ModelFormatError, match="the plain backend does not run mixture-of-experts"):
        load_model(GGUFFile.open(files["mixtral"], tmp_path), NoMoe())


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_torch_backend_conforms(files, variant: str) -> None:
    """The torch backend's MoE layer (on the CPU here) within the same calibrated bounds."""
    pytest.importorskip("torch")
    ref = load_fixture(variant)
    assert failures(teacher_forced(files[variant], ref, "torch"), ref) == []
