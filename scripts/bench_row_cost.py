"""Cost of one forward step by its number of rows: r sequences decoding together (batched decode), and
one sequence scoring r tokens at once (a speculative verify step or a prefill chunk), on one engine.

    python scripts/bench_row_cost.py MODEL [-t 2] [--rows 1,2,4,8,16] [--rounds 5]

Steps are timed around engine.step() (decode; only steps where all r sequences decode) and around
the model's forward pass (verify-like); rounds interleave the row counts so load drifts hit them
alike. Prints the median ms a step, its spread, ms per row, and the ratio to r single-row steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.sampling_params import SamplingParams

PROMPT = list(range(1000, 1064))  # 64 ordinary token ids: every model here has them


def decode_steps(engine: LLMEngine, rows: int, steps: int) -> list[float]:
    """Seconds of each engine step in which all `rows` sequences decode one token."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request([*PROMPT, i], params) for i in range(rows)]
    times = []
    while engine.has_unfinished():
        decoding = all(engine.requests[i].seq.num_computed_tokens >= len(PROMPT) + 1 for i in ids)
        start = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == rows:
            times.append(time.perf_counter() - start)
    return times


def verify_steps(engine: LLMEngine, rows: int, steps: int) -> list[float]:
    """Seconds of a forward pass over the first `rows` tokens of one sequence (logits of the last)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        score_tokens(engine, PROMPT[:rows], positions=[rows - 1])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    config = EngineConfig(
        model=str(Path(a.model).expanduser()), threads=a.threads, ctx_size=512, max_num_seqs=max(rows)
    )
    engine = LLMEngine(config)
    results: dict[tuple[str, int], list[float]] = {}
    for rnd in range(a.rounds + 1):  # round 0 warms up (compiles, and the thread governor learns)
        for r in rows:
            for mode, fn in (("decode", decode_steps), ("verify", verify_steps)):
                t = fn(engine, r, a.steps)
                if rnd:
                    results.setdefault((mode, r), []).extend(t)
    print(f"load average {os.getloadavg()[0]:.1f}; {a.threads} threads; median ms of a step (IQR)")
    print("| mode | rows | ms/step | IQR | ms/row | step / (rows x 1-row step) |")
    print("|---|---|---|---|---|---|")
    for mode in ("decode", "verify"):
        one = statistics.median(results[(mode, rows[0])]) * 1e3 / rows[0]
        for r in rows:
            ms = np.array(results[(mode, r)]) * 1e3
            med = float(np.median(ms))
            q1, q3 = np.percentile(ms, [25, 75])
            print(f"| {mode} | {r} | {med:.2f} | {q1:.2f}-{q3:.2f} | {med / r:.2f} | {med / (r * one):.2f} |")


if __name__ == "__main__":
    main()
