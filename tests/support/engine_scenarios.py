"""Drive an LLMEngine through arrival patterns; shared by the tiny-model and real-model engine tests."""

from __future__ import annotations

import random

from localllm.engine.engine import LLMEngine
from localllm.sampling_params import SamplingParams


def run_with_arrivals(
    engine: LLMEngine, prompts: list, params: SamplingParams, seed: int
) -> dict[int, list[int]]:
    """Add prompts at random steps while the engine runs; returns generated ids per prompt index."""
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    tokens: dict[int, list[int]] = {i: [] for i in order}
    ids: dict[str, int] = {}
    step = 0
    while order or engine.has_unfinished():
        while order and (not engine.has_unfinished() or rng.random() < 0.3):
            i = order.pop()
            ids[engine.add_request(prompts[i], params, request_id=f"p{i}-{seed}")] = i
        for out in engine.step():
            if out.token_id is not None and not (
                out.finish_reason == "stop" and out.stop_reason == out.token_id
            ):
                tokens[ids[out.request_id]].append(out.token_id)
        step += 1
    return tokens


def alone(engine: LLMEngine, prompt, params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].token_ids
