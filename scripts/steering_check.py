"""How often structured output's budget steering changes a value, and whether the reply then says so.

    python scripts/steering_check.py [MODEL] [--threads N]   (MODEL: a registry name or a GGUF path,
                                                                default smollm2-135m-instruct)

For each of the 20 schema prompts of tests/fixtures/structured_parse.py it asks (greedily, or sampled
with a seed: each position's draw depends only on the seed and the position, so a run repeats) for the
schema-constrained answer with room to spare (the reference: its tokens are the answer's
length N), then again with max_tokens at 0.5x, 0.75x, 1x, 1.25x, 1.5x, 2x and 3x N, all in one batch.
Each reply is sorted by what it says and what it holds against the reference:

    same      finish "stop", the reference's values
    steered   finish "closed_to_fit" (sent as "length"): budget steering changed it, and says so
    cut       finish "length": cut by max_tokens, invalid JSON (parse() raises)
    SILENT    finish "stop" but values other than the reference's: must be 0 (issue 34)

It prints a row per schema and the totals, and exits 1 when any reply is SILENT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))

FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
ROOM = 1024  # the reference's max_tokens


def classify(text: str, reason: str, reference: object) -> str:
    if reason == "closed_to_fit":
        return "steered"
    if reason == "stop":
        try:
            return "same" if json.loads(text) == reference else "SILENT"
        except json.JSONDecodeError:
            return "SILENT"
    return "cut" if reason == "length" else reason


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="with --seed: reproducible too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--factors", default=",".join(map(str, FACTORS)), help="budgets, x the answer's length"
    )
    args = parser.parse_args(argv)

    from structured_parse import CASES

    from localllm.llm import LLM
    from localllm.sampling_params import SamplingParams
    from localllm.structured.spec import StructuredSpec

    started = time.perf_counter()
    llm = LLM(args.model, threads=args.threads, max_num_seqs=32)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for _, p in CASES]
    specs = [StructuredSpec.json_schema(schema.model_json_schema()) for schema, _ in CASES]

    def params(spec: StructuredSpec, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature, seed=args.seed, max_tokens=max_tokens, structured=spec
        )

    refs = llm.engine.generate(prompts, [params(s, ROOM) for s in specs])
    factors = [float(f) for f in args.factors.split(",")]
    jobs = [(i, f, max(1, round(f * len(ref.token_ids)))) for i, ref in enumerate(refs) for f in factors]
    outs = llm.engine.generate([prompts[i] for i, _, _ in jobs], [params(specs[i], b) for i, _, b in jobs])
    totals: Counter[str] = Counter()
    by_factor: dict[float, Counter[str]] = {f: Counter() for f in factors}
    for i, (schema, _) in enumerate(CASES):
        ref = refs[i]
        if ref.finish_reason != "stop":  # no answer of the model's own to compare with
            print(f"{schema.__name__:10s} reference ended {ref.finish_reason}: skipped")
            continue
        row = []
        for (j, f, budget), out in zip(jobs, outs, strict=True):
            if j != i:
                continue
            kind = classify(out.text, out.finish_reason or "", json.loads(ref.text))
            totals[kind] += 1
            by_factor[f][kind] += 1
            row.append(f"{f}x={budget}:{kind}")
        print(f"{schema.__name__:10s} N={len(ref.token_ids):3d} ({ref.finish_reason}) " + " ".join(row))
    print("\nby budget: " + "; ".join(f"{f}x {dict(c)}" for f, c in by_factor.items()))
    print(f"totals over {len(jobs)} replies: {dict(totals)}")
    print(f"model {llm.name}, {time.perf_counter() - started:.0f} s")
    return 1 if totals["SILENT"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
