"""The PyTorch backend against the NumPy oracle: every architecture's logits, greedy generation, and the
engine's batching, prefix caching and preemption, on the CPU here; the same on CUDA/MPS where present."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from arch_conformance import compare, greedy, greedy_problem, load_fixture, near_tie, teacher_forced
from engine_scenarios import alone, run_with_arrivals
from paths import DATA
from reference_check import MODELS, VARIANT, first_near_tie, load_cases, logits_report
from reference_check import teacher_forced as reference_agreement
from tiny_arch import ARCHS, VARIANTS, write_arch_model, write_variant

from localllm.backends import make_backend
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import ConfigError
from localllm.sampling_params import SamplingParams

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="PyTorch is not installed (pip install 'localllm[torch]')"
)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(5, 53))  # 48 tokens: three times the 16-token windows


def _gpu() -> str | None:
    if not HAS_TORCH:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


needs_gpu = pytest.mark.skipif(_gpu() is None, reason="needs a CUDA or MPS device visible to PyTorch")


def make_engine(path, backend: str = "torch", device: str = "cpu", **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("ctx_size", 128)
    return LLMEngine(EngineConfig(model=str(path), backend=backend, device=device, threads=1, **kw))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes of up to 20 tokens (prefix cache hits), of mixed lengths."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, size=20).tolist()
    return [
        shared[: rng.integers(1, 20)] + rng.integers(3, 250, size=rng.integers(1, 40)).tolist()
        for _ in range(n)
    ]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("torch-arch")
    return {(a, q): write_arch_model(d / f"{a}-{q}.gguf", a, q) for a in ARCHS for q in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("torch-variants")
    return {v: write_variant(d / f"{v}.gguf", v) for v in VARIANTS}


@pytest.fixture(scope="module")
def numpy_engine(tiny_model_path) -> LLMEngine:
    return make_engine(tiny_model_path, backend="numpy")


# ---- without torch, or whatever the machine ---------------------------------------------------------


def test_missing_torch_is_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(
        ConfigError, match=r"^the torch backend needs PyTorch: pip install 'localllm\[torch\]'$"
    ):
        make_backend("torch", 1)


def test_unknown_device_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        EngineConfig(model="x.gguf", backend="torch", device="tpu")


def test_import_localllm_does_not_import_torch() -> None:
    code = "import sys, localllm, localllm.backends, localllm.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- CPU: against the NumPy oracle -------------------------------------------------------------------


@needs_torch
def test_auto_device_and_missing_devices() -> None:
    import torch

    from localllm.backends.torch_backend import resolve_device

    expected = "cuda" if torch.cuda.is_available() else _gpu() or "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda"):
            resolve_device("cuda")


@needs_torch
@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_the_numpy_oracle(arch_models, arch: str, quant: str) -> None:
    """Same dequantized float32 weights, so only float rounding differs (sums in another order); the
    prompt spans three sliding windows, and gemma3 covers q/k norms, post-norms, GeGLU and two RoPEs."""
    path = arch_models[arch, quant]
    expected = score_tokens(make_engine(path, backend="numpy"), PROMPT)
    got = score_tokens(make_engine(path), PROMPT)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert rel_err(got, expected) < 5e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@needs_torch
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_the_oracle_and_llama_cpp(variants, variant: str) -> None:
    """Llama 3's RoPE factors, qwen3, gemma2's soft-caps, phi3's fused tensors and LongRoPE, YaRN: the
    oracle's logits to float rounding, and llama.cpp's choices wherever they are clear."""
    ref = load_fixture(variant)
    engine = make_engine(variants[variant])
    got = teacher_forced(engine, ref)
    # peaky outputs (scaled 16x) magnify a last-bit difference in an f16 cache entry: looser than above
    assert rel_err(got, teacher_forced(make_engine(variants[variant], backend="numpy"), ref)) < 3e-3
    result = compare(got, ref, near_tie(ref))
    assert result["problems"] == []
    assert result["figures"]["rms_last"] < 1.5 * ref["calibration"]["rms_last"] + 0.02
    assert greedy_problem(greedy(engine, ref), ref) is None


@needs_torch
@pytest.mark.parametrize("cache", ["f16", "f32"])
def test_greedy_generation_equals_numpy(tiny_model_path, numpy_engine, cache: str) -> None:
    types = {"cache_type_k": cache, "cache_type_v": cache}
    engine = make_engine(tiny_model_path, **types)
    reference = numpy_engine if cache == "f16" else make_engine(tiny_model_path, "numpy", **types)
    for p in prompts(4, seed=7):
        assert alone(engine, p, GREEDY) == alone(reference, p, GREEDY)


@needs_torch
def test_batching_prefix_cache_and_preemption_give_the_same_outputs(tiny_model_path, numpy_engine) -> None:
    """Mixed prefill chunks and decodes in one step, cached prefixes and recomputed preempted sequences
    all give each request what it gets alone on the oracle."""
    ps = prompts(10, seed=3)
    expected = {i: alone(numpy_engine, p, GREEDY) for i, p in enumerate(ps)}
    cached = make_engine(tiny_model_path, max_num_batched_tokens=48)
    assert run_with_arrivals(cached, ps, GREEDY, seed=1) == expected
    no_cache = make_engine(tiny_model_path, enable_prefix_caching=False)
    assert run_with_arrivals(no_cache, ps, GREEDY, seed=2) == expected
    # 8 blocks of 16 tokens cannot hold 8 sequences of ~50 tokens: preemption must happen
    tight = make_engine(tiny_model_path, num_kv_blocks=8, max_num_seqs=8)
    assert run_with_arrivals(tight, ps, GREEDY, seed=4) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 8


@needs_torch
@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_stack_matches_the_oracle(arch_models, tiny_model_path, arch: str) -> None:
    """The fixed-shape decode stack CUDA captures as graphs, run eagerly here: padded batch buckets,
    scratch-slot padding rows, windows over whole block tables; batched, preempted and alone alike."""
    path = arch_models[arch, "F32"]
    reference = make_engine(path, backend="numpy")
    engine = make_engine(path)
    engine.backend.static_decode = True
    ps = prompts(8, seed=5)
    expected = {i: alone(reference, p, GREEDY) for i, p in enumerate(ps)}
    assert run_with_arrivals(engine, ps, GREEDY, seed=1) == expected
    tight = make_engine(path, num_kv_blocks=8, max_num_seqs=8)
    tight.backend.static_decode = True
    assert run_with_arrivals(tight, ps, GREEDY, seed=4) == expected
    assert tight.scheduler.num_preemptions > 0
    assert len(engine.backend._static) > 1  # several batch buckets were built and used


# ---- the real models against llama.cpp, as models/test_reference_models.py checks the Numba backend ----


@pytest.fixture(scope="module")
def real_engines(request, model_index_dir):
    """One torch engine (CPU, default f16 KV cache) per real model, built on first use."""
    built: dict[str, LLMEngine] = {}

    def get(model: str) -> LLMEngine:
        if model not in built:
            path = request.getfixturevalue(MODELS[model][0])
            built[model] = make_engine(
                path, ctx_size=1024, max_num_seqs=1, max_num_batched_tokens=1024, index_dir=model_index_dir
            )
        return built[model]

    return get


# All three real models, as tests/models/test_reference_models.py checks the Numba backend (dense float32
# weights: 1-2.5 GB each, ~2-3 minutes on 2 cores); LOCALLLM_TORCH_ALL_MODELS=0 keeps only SmolLM2.
REAL_MODELS = ("smollm2",) if os.environ.get("LOCALLLM_TORCH_ALL_MODELS") == "0" else tuple(MODELS)


def real_cases(kind: str) -> list:
    out = []
    for model in REAL_MODELS:
        greedy_cases, top10 = load_cases(DATA / model)
        for case in greedy_cases if kind == "greedy" else top10["prompts"]:
            out.append(pytest.param(model, case, id=f"{model}-{case['name']}"))
    return out


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("model,case", real_cases("greedy"))
def test_real_model_teacher_forced_and_greedy(real_engines, model: str, case: dict) -> None:
    engine, bounds, ref = real_engines(model), MODELS[model][1], case[VARIANT]
    generated, margins = ref["generated_ids"], ref["top1_minus_top2"]
    logits = score_tokens(engine, case["prompt_ids"] + generated)
    agreement = reference_agreement(logits, case["n_prompt"], generated, margins)
    assert agreement.confident_agree == agreement.confident_total, agreement
    assert agreement.overall >= bounds.overall, agreement
    params = SamplingParams(temperature=0, max_tokens=len(generated), ignore_eos=True)
    ours = engine.generate([case["prompt_ids"]], params)[0].token_ids
    n = first_near_tie(margins)
    assert ours[:n] == generated[:n], f"diverged before the first near-tie at step {n}"


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("model,case", real_cases("top10"))
def test_real_model_last_position_logits(real_engines, model: str, case: dict) -> None:
    bounds = MODELS[model][1]
    theirs = np.load(DATA / model / f"logits_{case['name']}.{VARIANT}.npy").astype(np.float32)
    ours = score_tokens(real_engines(model), case["prompt_ids"])[-1]
    rms, same_top1, _ = logits_report(ours, theirs)
    assert rms <= bounds.rms.get(case["name"], bounds.default_rms), f"RMS {rms:.3f}"
    assert same_top1


# ---- CUDA / MPS: the same checks on the device (skipped here) -----------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_logits_track_the_oracle(arch_models, arch: str) -> None:
    """bf16/fp16 weights: not float rounding any more, but the same predictions almost everywhere."""
    path = arch_models[arch, "F32"]
    expected = score_tokens(make_engine(path, backend="numpy"), PROMPT)
    got = score_tokens(make_engine(path, device=_gpu()), PROMPT)
    assert rel_err(got, expected) < 0.05
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.9


@pytest.mark.gpu
@needs_gpu
def test_gpu_batching_prefix_cache_and_preemption_agree(tiny_model_path) -> None:
    """On the device, requests get the same tokens batched, cached, preempted as alone. Half-precision
    GEMMs may pick another kernel per batch size, so a near-tie may flip: most must agree exactly."""
    ps = prompts(10, seed=3)
    gpu = make_engine(tiny_model_path, device=_gpu())
    expected = {i: alone(gpu, p, GREEDY) for i, p in enumerate(ps)}
    tight = make_engine(tiny_model_path, device=_gpu(), num_kv_blocks=8, max_num_seqs=8)
    for engine, seed in ((gpu, 1), (tight, 4)):
        got = run_with_arrivals(engine, ps, GREEDY, seed=seed)
        assert sum(got[i] == expected[i] for i in expected) >= 8, (got, expected)
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu() != "cuda", reason="CUDA graphs need a CUDA device")
def test_cuda_graph_decode_equals_the_paged_path(arch_models) -> None:
    """Decode replayed from captured graphs gives exactly the tokens of the same stack run eagerly (the
    same kernels on the same shapes)."""
    for arch in ARCHS:
        graphs = make_engine(arch_models[arch, "F32"], device="cuda")
        assert graphs.backend.static_decode and graphs.backend.cuda_graphs
        eager = make_engine(arch_models[arch, "F32"], device="cuda")
        eager.backend.cuda_graphs = False
        ps = prompts(8, seed=6)
        assert run_with_arrivals(graphs, ps, GREEDY, seed=1) == run_with_arrivals(eager, ps, GREEDY, seed=1)
        assert graphs.backend._static
