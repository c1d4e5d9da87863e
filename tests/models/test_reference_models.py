"""The real models against llama.cpp, as ../shared/reference/README.md defines "matches llama.cpp".

Reference data (llama.cpp b11312, all-fp32 attention `fa_off_kvf32`) is copied into tests/data/<model>/.
SmolLM2 runs on the NumPy reference backend too; every model runs on the Numba kernels both fused (with
the default f16 KV cache) and op by op (with an f32 one).
"""

from __future__ import annotations

import numpy as np
import pytest
from paths import DATA
from reference_check import (  # noqa: F401
    MODELS,
    VARIANT,
    Bounds,
    first_near_tie,
    load_cases,
    logits_report,
    teacher_forced,
)

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
# llama.cpp's all-fp32 attention. It is also the closer reference for our f16 KV cache: llama.cpp's
# f16 setting (`fa_off`) rounds the queries and the attention weights to f16 as well, we keep those in
# f32 (measured: all 32 fused f16 cases pass against fa_off_kvf32; against fa_off SmolLM2's
# chat_capital agrees on 45 of 48 positions, 93.8% < 95%, every confident one included).


# "numba" runs each step's layers as one fused call with the default f16 KV cache; "numba-ops" runs the
# same specs op by op with an f32 cache (as does the NumPy oracle).
RUNS = [("smollm2", "numpy")] + [
    (m, b) for m in ("smollm2", "qwen25c", "gemma3") for b in ("numba", "numba-ops")
]


def kv_type(backend: str) -> str:
    return "f16" if backend == "numba" else "f32"


@pytest.fixture(scope="module")
def engines(request, model_index_dir):
    """One engine per (model, backend), built on first use and shared by the module's tests."""
    built: dict[tuple[str, str], LLMEngine] = {}

    def get(model: str, backend: str) -> LLMEngine:
        if (model, backend) not in built:
            path = request.getfixturevalue(MODELS[model][0])
            config = EngineConfig(
                model=str(path),
                backend=backend.removesuffix("-ops"),
                ctx_size=1024,
                max_num_seqs=1,
                max_num_batched_tokens=1024,
                index_dir=model_index_dir,
                threads=2,
                cache_type_k=kv_type(backend),
                cache_type_v=kv_type(backend),
            )
            engine = built[(model, backend)] = LLMEngine(config)
            if engine.backend.name == "numba":
                engine.backend.fuse_layers = not backend.endswith("-ops")
                assert engine.backend.fused(engine.model) == engine.backend.fuse_layers
        return built[(model, backend)]

    return get


def _avx2_only() -> bool:
    from localllm.kernels.simd_x512 import HAVE_AVX2, HAVE_AVX512

    return HAVE_AVX2 and not HAVE_AVX512


# A known gap on AVX2-only machines, measured at 954aa0f and since: at step 20 of raw_code llama.cpp's
# margin is 0.96 and the integer path puts another token 0.56 above it (the NumPy oracle and the float
# path agree with llama.cpp: +1.04). Not an AVX2 defect: the AVX2 and AVX-512 kernels give the same
# integer sums and float steps; what differs is float rounding elsewhere (8- vs 16-lane reductions), and
# this step amplifies it through the 8-bit activations (SmolLM2's 32-blocks hold outliers up to 649x
# their median). Activations perturbed by 1e-7 relative (about one ulp) before quantization move the
# margin to 0.76, 0.22, 0.64, 0.83 (4 seeds; 1e-6: 0.71, -0.55, 1.33), the float path's stays 1.04;
# the q/k/v projections alone move it 1.04 -> 0.45. llama.cpp's Q8_1 activations are as noisy (its last-
# position logits are 0.18/0.16 RMS from the float path's, ours 0.14/0.16). Strict: it is deterministic
# on a given machine, and a change of the activation rounding should revisit it (issue 33).
KNOWN_GAPS = {
    ("teacher", "smollm2-numba-ops-raw_code"): "8-bit activations on AVX2: 45/46 confident tokens (issue 33)"
}


def cases(kind: str, test: str = "") -> list:
    out = []
    for model, backend in RUNS:
        greedy, top10 = load_cases(DATA / model)
        for case in greedy if kind == "greedy" else top10["prompts"]:
            name = f"{model}-{backend}-{case['name']}"
            gap = KNOWN_GAPS.get((test, name))
            marks = [pytest.mark.xfail(_avx2_only(), reason=gap, strict=True)] if gap else []
            out.append(pytest.param(model, backend, case, id=name, marks=marks))
    return out


@pytest.mark.parametrize("model,backend,case", cases("greedy", "teacher"))
def test_teacher_forced_agreement(engines, model, backend, case):
    engine, bounds = engines(model, backend), MODELS[model][1]
    ref = case[VARIANT]
    generated, margins = ref["generated_ids"], ref["top1_minus_top2"]
    logits = score_tokens(engine, case["prompt_ids"] + generated)
    agreement = teacher_forced(logits, case["n_prompt"], generated, margins)
    assert agreement.confident_agree == agreement.confident_total, agreement
    assert agreement.overall >= bounds.overall, agreement


@pytest.mark.parametrize("model,backend,case", cases("greedy"))
def test_free_running_greedy(engines, model, backend, case):
    engine = engines(model, backend)
    ref = case[VARIANT]
    params = SamplingParams(temperature=0, max_tokens=len(ref["generated_ids"]), ignore_eos=True)
    ours = engine.generate([case["prompt_ids"]], params)[0].token_ids
    n = first_near_tie(ref["top1_minus_top2"])
    assert ours[:n] == ref["generated_ids"][:n], f"diverged before the first near-tie at step {n}"


@pytest.mark.parametrize("model,backend,case", cases("top10"))
def test_last_position_logits(engines, model, backend, case):
    engine, bounds = engines(model, backend), MODELS[model][1]
    theirs = np.load(DATA / model / f"logits_{case['name']}.{VARIANT}.npy").astype(np.float32)
    ours = score_tokens(engine, case["prompt_ids"])[-1]
    rms, same_top1, shared = logits_report(ours, theirs)
    assert rms <= bounds.rms.get(case["name"], bounds.default_rms), f"RMS {rms:.3f}"
    assert same_top1
    assert shared >= 8, f"only {shared} of the top-10 shared"
