"""Interleaved rounds of `localllm bench --llama-bench` on a shared machine: each round runs localllm's
tests then llama-bench's (`-r 1`), so both see the same load; the figure is the median of the rounds'
ratios, the range beside it, and each engine's median rate.

    python scripts/alternate_bench.py --llama-bench $LLAMA/build/bin/llama-bench -p 128 -n 32 -t 1,2 \\
        --rounds 3 [--cpu avx2|avx2-vnni|portable] MODEL [MODEL ...]

Prints a Markdown table (model, test, threads, localllm, llama.cpp, ratio median, range, kernel family).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def one_round(model: str, args: argparse.Namespace) -> dict:
    pretend = [str(Path(__file__).with_name("pretend_cpu.py")), args.cpu]
    runner = pretend if args.cpu else ["-m", "localllm"]
    cmd = [sys.executable, *runner, "bench", "-m", model, "-p", args.p, "-n", args.n]
    cmd += ["-t", args.t, "-r", "1", "--llama-bench", args.llama_bench, "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    print(out, file=sys.stderr, flush=True)  # every round's own figures, kept when piped aside
    return json.loads(out[out.index("{") :])


def summarise(model: str, rounds: list[dict]) -> list[str]:
    rates: dict = defaultdict(list)
    for r in rounds:
        for row in r["results"]:
            rates[(row["test"], row["threads"], row["engine"])].append(row["tokens_per_s"])
    family = rounds[0]["system"].get("kernels", "")
    lines = []
    for test, threads in sorted({(t, n) for t, n, _ in rates}):
        ours, theirs = rates[(test, threads, "localllm")], rates[(test, threads, "llama.cpp")]
        ratio = sorted(a / b for a, b in zip(ours, theirs, strict=True))
        medians = f"{statistics.median(ours):.1f}", f"{statistics.median(theirs):.1f}"
        cells = [model, test, str(threads), *medians]
        cells += [f"**{statistics.median(ratio):.2f}x**", f"{ratio[0]:.2f}-{ratio[-1]:.2f}", family]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-p", default="128")
    ap.add_argument("-n", default="32")
    ap.add_argument("-t", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--cpu",
        choices=["avx2", "avx2-vnni", "portable"],
        help="localllm as this smaller CPU (pretend_cpu.py)",
    )
    args = ap.parse_args()
    print("| model | test | threads | localllm t/s | llama.cpp t/s | ratio (median) | range | kernels |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        rounds = [one_round(model, args) for _ in range(args.rounds)]
        print("\n".join(summarise(model, rounds)), flush=True)


if __name__ == "__main__":
    main()
