"""What speculative decoding with a draft model costs, in units of one target decode step: a target step
of r query rows (a verify step with r - 1 drafts) and a draft model step of r rows (one drafted token at
r = 1; catching up at r > 1), both after the same 120-token context, rounds interleaved.

    python scripts/bench_spec_costs.py TARGET DRAFT [-t 1] [--rows 1,2,3,4,5,9,17] [--rounds 5]
        [--draft-vocab 0,32768]

-t fixes the thread count (the governor's choice is taken away, so both models run alike). Prints the
median ms of each and its ratio to a 1-row target step: s (a verify row) and d (a draft token) go into
the speed-up E(k) / (1 + k (s + d)), E(k) = (1 - a^(k+1)) / (1 - a) at acceptance rate a.
--draft-vocab times the draft with its output layer restricted as `--draft-vocab N` restricts it (0: whole).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from localllm.cli.common import resolve
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.scheduler import ScheduledSeq
from localllm.engine.sequence import Sequence
from localllm.sampling_params import SamplingParams

CONTEXT = np.random.default_rng(0).integers(100, 5000, size=120).tolist()


def draft_heads(draft: LLMEngine, target: LLMEngine, vocabs: str) -> dict[int, Any]:
    """The draft's output layer for each --draft-vocab value (0: its own, whole)."""
    from localllm.engine.draft_model import head_ids, restricted_head

    heads = {}
    for vocab in map(int, vocabs.split(",")):
        ids = head_ids(target.tokenizer, target.args.vocab_size, vocab)
        heads[vocab] = draft.model.output if ids is None else restricted_head(draft.gguf, draft.model, ids)
    return heads


def step_seconds(engine: LLMEngine, rows: int, head: Any = None) -> float:
    """One forward pass of `rows` query tokens after CONTEXT (its K/V written, then the blocks freed),
    with `head` as the output layer where given."""
    if head is not None:
        engine.model.output = head
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
    ap.add_argument("--draft-vocab", default="0")
    args = ap.parse_args()
    engines = {}
    for name in (args.target, args.draft):
        engines[name] = LLMEngine(EngineConfig(model=str(resolve(name)[0]), threads=args.threads))
        engines[name].backend.governor.candidates = [args.threads]  # a fixed thread count
    heads = draft_heads(engines[args.draft], engines[args.target], args.draft_vocab)
    cases = [(args.target, int(r), 0) for r in args.rows.split(",")]
    cases += [(args.draft, int(r), v) for r in args.draft_rows.split(",") for v in heads]
    for case in cases:  # warm-up: kernels compiled or loaded
        step_seconds(engines[case[0]], case[1], heads.get(case[2]) if case[0] == args.draft else None)
    times: dict[tuple[str, int, int], list[float]] = {c: [] for c in cases}
    for i in range(args.rounds):
        for name, rows, vocab in cases if i % 2 else cases[::-1]:
            head = heads[vocab] if name == args.draft else None
            times[(name, rows, vocab)].append(step_seconds(engines[name], rows, head))
    base = statistics.median(times[(args.target, 1, 0)])
    for (name, rows, vocab), samples in times.items():
        med = statistics.median(samples)
        head = f" (head: {vocab or 'all'} ids)" if name == args.draft else ""
        print(f"{name} {rows} rows{head}: {1000 * med:.1f} ms = {med / base:.2f} target steps")
    print(f"{args.threads} thread(s), load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
