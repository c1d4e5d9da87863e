"""How often structured output's budget steering changes a value, and whether the reply then says so.

    python scripts/steering_check.py [MODEL] [--threads N] [--temperature 0,0.7] [--seed S] [--schemas 20]
        (MODEL: a registry name or a GGUF path, default smollm2-135m-instruct)

The schema prompts are the 20 of tests/fixtures/structured_parse.py, then the spares below (used when a
model's answer to one of the 20 does not end by itself, so that --schemas of them are measured). For
each temperature (greedy, or sampled with a seed: each position's draw depends only on the seed and
the position, so a run repeats) it asks for the schema-constrained answer with room to spare (the
reference: its tokens are the answer's length N), then again with max_tokens at 0.5x, 0.75x, 1x, 1.25x,
1.5x, 2x and 3x N for the first --schemas prompts whose reference ended by itself, all temperatures in
one batch. Each reply is sorted by what it says and what it holds against the reference:

    same      finish "stop", the reference's values
    steered   finish "closed_to_fit" (sent as "length"): budget steering changed it, and says so
    cut       finish "length": cut by max_tokens, invalid JSON (parse() raises)
    SILENT    finish "stop" but values other than the reference's: must be 0 (issue 34)

It prints a row per schema, the totals by budget, and exits 1 when any reply is SILENT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))

FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
ROOM = 300  # the reference's max_tokens: these answers take under 150; past that a reply is looping


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool


class Song(BaseModel):
    title: str
    artist: str
    seconds: int


class Ticket(BaseModel):
    summary: str
    severity: Literal["low", "high", "critical"]
    components: list[str] = Field(max_length=3)


class Quote(BaseModel):
    text: str
    author: str


SPARES: list[tuple[type[BaseModel], str]] = [
    (Planet, "Describe Saturn."),
    (Song, "Name a famous song."),
    (Ticket, "File a bug report: the login page crashes."),
    (Quote, "Give a famous quote."),
]


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
    parser.add_argument("--temperature", default="0", help="one or more, comma-separated (with --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--room", type=int, default=ROOM, help="the reference's max_tokens")
    parser.add_argument("--schemas", type=int, default=20, help="schemas measured (of those that end)")
    parser.add_argument(
        "--factors", default=",".join(map(str, FACTORS)), help="budgets, x the answer's length"
    )
    args = parser.parse_args(argv)

    from structured_parse import CASES

    from localllm.llm import LLM
    from localllm.sampling_params import SamplingParams
    from localllm.structured.spec import StructuredSpec

    started = time.perf_counter()
    cases = CASES + SPARES
    llm = LLM(args.model, threads=args.threads, max_num_seqs=64)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for _, p in cases]
    specs = [StructuredSpec.json_schema(schema.model_json_schema()) for schema, _ in cases]
    temps = [float(t) for t in args.temperature.split(",")]

    def params(spec: StructuredSpec, temp: float, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=temp, seed=args.seed, max_tokens=max_tokens, structured=spec)

    keys = [(t, i) for t in temps for i in range(len(cases))]
    ref_params = [params(specs[i], t, args.room) for t, i in keys]
    outs = llm.engine.generate([prompts[i] for _, i in keys], ref_params)
    refs = dict(zip(keys, outs, strict=True))
    factors = [float(f) for f in args.factors.split(",")]
    jobs = []
    for t in temps:
        usable = [i for i in range(len(cases)) if refs[t, i].finish_reason == "stop"][: args.schemas]
        for i in range(len(cases)):
            if i not in usable and refs[t, i].finish_reason != "stop":  # (a spare not needed: silent)
                print(f"T={t} {cases[i][0].__name__:10s} reference ended {refs[t, i].finish_reason}: skipped")
        n = {i: len(refs[t, i].token_ids) for i in usable}
        jobs += [(t, i, f, max(1, round(f * n[i]))) for i in usable for f in factors]
    outs = llm.engine.generate(
        [prompts[i] for _, i, _, _ in jobs], [params(specs[i], t, b) for t, i, _, b in jobs]
    )
    report(cases, temps, factors, refs, jobs, outs)
    print(f"model {llm.name}, {time.perf_counter() - started:.0f} s")
    return 1 if classify_all(refs, jobs, outs)["SILENT"] else 0


def classify_all(refs: dict, jobs: list, outs: list) -> Counter[str]:
    return Counter(
        classify(out.text, out.finish_reason or "", json.loads(refs[t, i].text))
        for (t, i, _, _), out in zip(jobs, outs, strict=True)
    )


def report(cases: list, temps: list[float], factors: list[float], refs: dict, jobs: list, outs: list) -> None:
    """A row per (temperature, schema), then the counts by temperature and budget, and the totals."""
    by: dict[tuple[float, float], Counter[str]] = {(t, f): Counter() for t in temps for f in factors}
    rows: dict[tuple[float, int], list[str]] = {}
    for (t, i, f, budget), out in zip(jobs, outs, strict=True):
        kind = classify(out.text, out.finish_reason or "", json.loads(refs[t, i].text))
        by[t, f][kind] += 1
        rows.setdefault((t, i), []).append(f"{f}x={budget}:{kind}")
    for (t, i), row in rows.items():
        print(f"T={t} {cases[i][0].__name__:10s} N={len(refs[t, i].token_ids):3d} " + " ".join(row))
    for t in temps:
        print(f"\nT={t}: {len({i for tt, i in rows if tt == t})} schemas; by budget:")
        for f in factors:
            print(f"  {f}x {dict(by[t, f])}")
        total = sum((by[t, f] for f in factors), Counter())
        print(f"  totals over {sum(total.values())} replies: {dict(total)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
