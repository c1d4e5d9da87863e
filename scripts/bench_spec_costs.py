"""What speculative decoding with a draft model costs, in units of one target decode step: a target step
of r query rows (a verify step with r - 1 drafts) and a draft model step of r rows (one drafted token at
r = 1; catching up at r > 1), both after the same 120-token context, rounds interleaved.

    python scripts/bench_spec_costs.py TARGET DRAFT [-t 1] [--rows 1,2,3,4,5,9,17] [--rounds 5]

-t fixes the thread count (the governor's choice is taken away, so both models run alike). Prints the
median ms of each and its ratio to a 1-row target step: s (a verify row) and d (a draft token) go into
the speed-up E(k) / (1 + k (s + d)), E(k) = (1 - a^(k+1)) / (1 - a) at acceptance rate a.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from localllm.cli.common import resolve
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.scheduler import ScheduledSeq
from localllm.engine.sequence import Sequence
from localllm.sampling_params import SamplingParams

CONTEXT = np.random.default_rng(0).integers(100, 5000, size=120).tolist()


def step_seconds(engine: LLMEngine, rows: int) -> float:
    """One forward pass of `rows` query tokens after CONTEXT (its K/V written, then the blocks freed)."""
    seq = Sequence("cost", CONTEXT + [1] * rows, SamplingParams(temperature=0))
    engine.block_manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = len(CONTEXT)
    batch = engine.runner.prepare([ScheduledSeq(seq, rows)])
    batch.logits_indices = np.arange(rows, dtype=np.int64)
    start = time.perf_counter()
    engine.model.forward(batch, engine.kv_cache)
    seconds = time.perf_counter() - start
    engine.block_manager.free(seq)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,5,9,17")
    ap.add_argument("--draft-rows", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engines = {}
    for name in (args.target, args.draft):
        engines[name] = LLMEngine(EngineConfig(model=str(resolve(name)[0]), threads=args.threads))
        engines[name].backend.governor.candidates = [args.threads]  # a fixed thread count
    cases = [(args.target, int(r)) for r in args.rows.split(",")]
    cases += [(args.draft, int(r)) for r in args.draft_rows.split(",")]
    for name, rows in cases:  # warm-up: kernels compiled or loaded
        step_seconds(engines[name], rows)
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for i in range(args.rounds):
        for name, rows in cases if i % 2 else cases[::-1]:
            times[(name, rows)].append(step_seconds(engines[name], rows))
    base = statistics.median(times[(args.target, 1)])
    for (name, rows), samples in times.items():
        med = statistics.median(samples)
        print(f"{name} {rows} rows: {1000 * med:.1f} ms = {med / base:.2f} target steps")
    print(f"{args.threads} thread(s), load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
