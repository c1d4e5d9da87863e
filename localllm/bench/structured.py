"""Constrained decoding's cost: decode throughput with a JSON schema vs free text, in one run.

Runs interleaved (free, schema with the mask overlapping the forward pass, schema with the mask in
line), `reps` rounds, at batch 1 and a larger batch, each request generating exactly `n_gen` tokens
(free text ignores end-of-text; the schema admits only an array of at least `n_gen` strings, so it
cannot end early). Decode throughput excludes the prompt (first token).

    python -m localllm.bench.structured ~/.cache/localllm/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from localllm.sampling_params import SamplingParams
from localllm.structured.spec import StructuredSpec

PROMPT = "List some fruits as a JSON array of strings:"
MODES = ("free", "schema, overlap", "schema, in line")


def _params(mode: str, n_gen: int, seed: int) -> SamplingParams:
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": n_gen}
    structured = None if mode == "free" else StructuredSpec.json_schema(schema)
    # top_k 40 (run's default): with top_k 0 the sampler sorts the whole vocabulary each token, which
    # costs less when the mask has set most of it to -inf; that would flatter the constrained runs.
    return SamplingParams(
        temperature=0.8, top_k=40, seed=seed, max_tokens=n_gen, ignore_eos=True, loop_guard=False,
        structured=structured,
    )  # fmt: skip


def decode_rate(engine: Any, mode: str, n_gen: int, batch: int, seed: int) -> float:
    """Generated tokens per second after each request's first token, over the batch."""
    engine.runner._masks.overlap = mode != "schema, in line"
    params = [_params(mode, n_gen, seed + i) for i in range(batch)]
    outs = engine.generate([PROMPT] * batch, params)
    assert all(len(o.token_ids) == n_gen for o in outs), [len(o.token_ids) for o in outs]
    first = max(o.ttft or 0.0 for o in outs)
    last = max(o.elapsed for o in outs)
    return batch * (n_gen - 1) / (last - first)


def run(model: str, n_gen: int = 96, reps: int = 3, batches: tuple[int, ...] = (1, 8)) -> list[str]:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(batches)))
    for mode in MODES:  # warm: kernels, llguidance's tokenizer, the grammar, both sampling paths
        decode_rate(engine, mode, 8, max(batches), 0)
    lines = [f"load average before: {os.getloadavg()}"]
    for batch in batches:
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(reps):
            for mode in MODES[rep % 3 :] + MODES[: rep % 3]:  # each mode takes each turn once
                rates[mode].append(decode_rate(engine, mode, n_gen, batch, rep))
        free = statistics.mean(rates["free"])
        for mode in MODES:
            mean, sd = statistics.mean(rates[mode]), statistics.pstdev(rates[mode])
            cost = "" if mode == "free" else f" ({100 * (1 - mean / free):+.1f}% slower)"
            lines.append(f"batch {batch}: {mode:16s} {mean:7.1f} ± {sd:5.1f} tok/s{cost}")
    lines.append(f"load average after: {os.getloadavg()}")
    return lines


if __name__ == "__main__":
    print("\n".join(run(sys.argv[1], *(int(a) for a in sys.argv[2:4]))))  # MODEL [n_gen [reps]]
