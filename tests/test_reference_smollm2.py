"""SmolLM2-135M against llama.cpp (../shared/reference, copied into tests/data/smollm2), on each backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reference_check import first_near_tie, load_cases, logits_report, teacher_forced

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data" / "smollm2"
CASES, TOP10 = load_cases(DATA)
VARIANT = "fa_off_kvf32"  # all-fp32 attention: the closest llama.cpp setting to an fp32 engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["numpy", "numba"])
def engine(request, smollm2_path, index_dir) -> LLMEngine:
    config = EngineConfig(model=str(smollm2_path), backend=request.param, ctx_size=512, max_num_seqs=16,
                          index_dir=index_dir, threads=2)  # fmt: skip
    return LLMEngine(config)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_teacher_forced_agreement(engine, case):
    ref = case[VARIANT]
    generated, margins = ref["generated_ids"], ref["top1_minus_top2"]
    logits = score_tokens(engine, case["prompt_ids"] + generated)
    agreement = teacher_forced(logits, case["n_prompt"], generated, margins)
    assert agreement.confident_agree == agreement.confident_total, agreement
    assert agreement.overall >= 0.95, agreement


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_free_running_greedy(engine, case):
    ref = case[VARIANT]
    params = SamplingParams(temperature=0, max_tokens=len(ref["generated_ids"]), ignore_eos=True)
    ours = engine.generate([case["prompt_ids"]], params)[0].token_ids
    n = first_near_tie(ref["top1_minus_top2"])
    assert ours[:n] == ref["generated_ids"][:n], f"diverged before the first near-tie at step {n}"


@pytest.mark.parametrize("case", TOP10["prompts"], ids=[c["name"] for c in TOP10["prompts"]])
def test_last_position_logits(engine, case):
    theirs = np.load(DATA / f"logits_{case['name']}.{VARIANT}.npy").astype(np.float32)
    ours = score_tokens(engine, case["prompt_ids"])[-1]
    rms, same_top1, shared = logits_report(ours, theirs)
    assert rms <= 0.3, f"RMS {rms:.3f}"
    assert same_top1
    assert shared >= 8, f"only {shared} of the top-10 shared"
