"""Two localllm builds (and optionally llama.cpp) in alternating rounds on the same files: each round runs
`localllm bench -r 1` of build A, then of build B, then llama-bench, so all see the same machine load.

    python scripts/ab_bench.py --a /work/main/.venv/bin/localllm --b .venv/bin/localllm \\
        [--llama-bench $LLAMA/build/bin/llama-bench] -p 0 -n 64 -t 1,2 --rounds 5 MODEL [MODEL ...]

Prints per (model, test, threads) each engine's median tokens/s, and the medians (ranges) of the rounds'
ratios B/A and B/llama.cpp; also each build's CPU time per generated token (the process's user + system time
over its tokens: the work a step does, which other tenants' load inflates far less than the wall time).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
from collections import defaultdict


def _run(cmd: list[str]) -> tuple[dict, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out[out.index("{") :]), cpu


def _rates(report: dict) -> dict[tuple[str, int], float]:
    return {(r["test"], int(r["threads"])): r["tokens_per_s"] for r in report["results"]}


def one_round(model: str, a: argparse.Namespace, rates: dict, cpu: dict) -> None:
    common = ["bench", "-m", model, "-p", a.p, "-n", a.n, "-t", a.t, "-r", "1", "-o", "json"]
    for name, exe in (("A", a.a), ("B", a.b)):
        report, seconds = _run([exe, *common])
        for key, value in _rates(report).items():
            rates[(name, *key)].append(value)
        cpu[name].append(seconds)
    if a.llama_bench:
        cmd = [a.llama_bench, "-m", model, "-p", a.p, "-n", a.n, "-t", a.t, "-r", "1", "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for row in json.loads(out):
            test = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
            rates["llama.cpp", test, int(row["n_threads"])].append(float(row["avg_ts"]))


def _ratio(num: list[float], den: list[float]) -> str:
    r = sorted(x / y for x, y in zip(num, den, strict=True))
    return f"**{statistics.median(r):.2f}x** ({r[0]:.2f}-{r[-1]:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--a", required=True, help="build A's localllm executable (the baseline)")
    ap.add_argument("--b", required=True, help="build B's localllm executable")
    ap.add_argument("--llama-bench")
    ap.add_argument("-p", default="0")
    ap.add_argument("-n", default="64")
    ap.add_argument("-t", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print("| model | test | threads | A t/s | B t/s | llama.cpp t/s | B / A | B / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models:
        rates: dict = defaultdict(list)
        cpu: dict = defaultdict(list)
        for _ in range(a.rounds):
            one_round(model, a, rates, cpu)
        for _, test, threads in sorted(k for k in rates if k[0] == "A"):
            ours, base = rates["B", test, threads], rates["A", test, threads]
            theirs = rates.get(("llama.cpp", test, threads), [])
            cells = [model.rsplit("/", 1)[-1], test, str(threads), f"{statistics.median(base):.1f}"]
            cells += [f"{statistics.median(ours):.1f}", f"{statistics.median(theirs):.1f}" if theirs else "-"]
            cells += [_ratio(ours, base), _ratio(ours, theirs) if theirs else "-"]
            print("| " + " | ".join(cells) + " |", flush=True)
        print(f"CPU seconds per run (whole bench process), A: {statistics.median(cpu['A']):.2f}, "
              f"B: {statistics.median(cpu['B']):.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
