"""The loop guard ends replies that repeat one span many times, and nothing else."""

from __future__ import annotations

import time

import numpy as np
import pytest

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.loop_guard import MAX_SPAN, MIN_REPEATS, MIN_TOKENS, LoopGuard
from localllm.sampling_params import SamplingParams


def first_hit(tokens: list[int]) -> tuple[int, int]:
    """(index of the token that trips the guard, span length), or (-1, 0)."""
    guard = LoopGuard()
    for i, t in enumerate(tokens):
        if span := guard.add(t):
            return i, span
    return -1, 0


@pytest.mark.parametrize("span", [1, 2, 7, 24, MAX_SPAN])
def test_a_repeated_span_trips_once_long_enough(span):
    rng = np.random.default_rng(span)
    intro = rng.integers(1000, 2000, size=50).tolist()
    unit = rng.integers(0, 1000, size=span).tolist()
    while len(set(unit)) < span:  # a span with no shorter period
        unit = rng.integers(0, 1000, size=span).tolist()
    index, found = first_hit(intro + unit * 200)
    needed = max(MIN_REPEATS * span, MIN_TOKENS)  # loop tokens seen when it trips
    assert found == span and index == len(intro) + needed - 1


def test_ordinary_text_and_short_repeats_pass():
    rng = np.random.default_rng(0)
    assert first_hit(rng.integers(0, 50, size=5000).tolist()) == (-1, 0)
    # a refrain repeated 3 times, a long run of one token shorter than MIN_TOKENS, a table rule
    assert first_hit(list(range(40)) * 3 + [7] * (MIN_TOKENS - 1) + [9, 1] * 20) == (-1, 0)
    # a span longer than MAX_SPAN is not looked for (the length limit ends such replies)
    assert first_hit(list(range(MAX_SPAN + 1)) * 10) == (-1, 0)


def test_cost_per_token_is_small():
    guard, tokens = LoopGuard(), np.random.default_rng(1).integers(0, 1000, size=2000).tolist()
    start = time.perf_counter()
    for t in tokens:
        guard.add(t)
    assert (time.perf_counter() - start) / len(tokens) < 100e-6  # ~5 us here; a token takes >= 5 ms


@pytest.fixture(scope="module")
def engine(tiny_model_path, index_dir):
    config = EngineConfig(model=str(tiny_model_path), backend="numpy", threads=1, index_dir=index_dir)
    return LLMEngine(config)


def test_engine_ends_a_looping_reply(engine):
    # The tiny random model, greedy, soon repeats one token for good.
    looped = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=240))[0]
    assert looped.finish_reason == "repetition" and len(looped.token_ids) < 240
    assert len(set(looped.token_ids[-MIN_TOKENS:])) == 1
    off = SamplingParams(temperature=0, max_tokens=240, loop_guard=False)
    exact = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)  # benchmarks: exact lengths
    assert engine.generate([[5, 6, 7]], off)[0].finish_reason != "repetition"
    assert len(engine.generate([[5, 6, 7]], exact)[0].token_ids) == 240
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
