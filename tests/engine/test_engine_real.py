"""On the real model: a sequence's greedy output is the same alone, in a batch of 16 arriving at random
steps, under preemption, and with the prefix cache on or off."""

from __future__ import annotations

import pytest
from engine_scenarios import alone, run_with_arrivals

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at",
    "My favourite book is",
    "The quick brown fox",
    "In 1969, the first humans",
    "To make a cake you need",
    "The largest planet in our solar system",
    "SELECT name FROM users WHERE",
    "Photosynthesis is",
    "The speed of light is",
    "A haiku about autumn:\n",
    "Dear team, I am writing to",
]


def make(path, index_dir, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine(
        EngineConfig(model=str(path), backend="numba", threads=2, ctx_size=256, index_dir=index_dir, **kw)
    )


@pytest.fixture(scope="module")
def reference(smollm2_path, index_dir):
    engine = make(smollm2_path, index_dir)
    prompts = [engine.tokenize_prompt(t) for t in TEXTS]
    return prompts, {i: alone(engine, p, GREEDY) for i, p in enumerate(prompts)}, engine


def test_batch_of_16_at_random_steps(reference):
    prompts, expected, engine = reference
    assert run_with_arrivals(engine, prompts, GREEDY, seed=0) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_under_preemption_and_without_prefix_cache(reference, smollm2_path, index_dir):
    prompts, expected, _ = reference
    tight = make(smollm2_path, index_dir, num_kv_blocks=24, enable_prefix_caching=False)
    assert run_with_arrivals(tight, prompts, GREEDY, seed=1) == expected
    assert tight.scheduler.num_preemptions > 0


def test_shared_prefix_hits_the_cache(reference):
    _, _, engine = reference
    long_prompt = engine.tokenize_prompt(" ".join(TEXTS))
    first = engine.generate([long_prompt], GREEDY)[0]
    again = engine.generate([long_prompt], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens == (len(long_prompt) - 1) // 16 * 16 > 0
