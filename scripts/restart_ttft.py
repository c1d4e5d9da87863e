"""A server restart with the prefix cache's disk tier: a long prompt's TTFT through `localllm serve`.

    python scripts/restart_ttft.py MODEL.gguf --tokens 4096 --threads 2 --rounds 3

Each round uses a fresh --kv-disk-dir: a server sends the prompt cold (its blocks written to disk), then
again (a memory hit); it is stopped and a new server started on the same directory sends it once more
(restored from disk: the first request the new process serves, as after a real restart), then again.
TTFT is the client's time from sending a streamed /v1/completions request (the prompt as text, greedy,
4 tokens, top-5 logprobs) to its first token. A server without the disk tier (--kv-disk-mb 0) answers the
prompt once; every reply's tokens and logprobs must be identical to its. The target (issue 31): disk
hit <= 1.5x the memory hit and >= 10x faster than the cold prefill. scripts/bench_kv_restart.py measures
the same in the engine alone, without the server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localllm.bench.server_process import local_server, serve_command  # noqa: E402


def serve(args: argparse.Namespace, disk: str | None):
    """A server context for the model, with the disk tier in `disk` (None: the tier off)."""
    extra = ["--kv-disk-mb", "4096", "--kv-disk-dir", disk] if disk else ["--kv-disk-mb", "0"]
    ctx = args.tokens + 256
    return local_server(lambda port: serve_command(args.model, port, "numba", args.threads, 1, ctx, extra))


def ask(url: str, prompt: str) -> dict:
    """One streamed greedy completion: TTFT (s), the tokens' texts and top-5 logprobs, cached tokens."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, ttft, texts, lps, usage = time.perf_counter(), None, [], [], {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice.get("logprobs") and choice["logprobs"].get("tokens"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    texts += choice["logprobs"]["tokens"]
                    lps.append([choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]])
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "tokens": texts, "lp": lps, "prompt_tokens": usage.get("prompt_tokens"),
            "cached": details.get("cached_tokens")}  # fmt: skip


def prompt_text(args: argparse.Namespace, url: str) -> str:
    """The first --tokens tokens of this repository's source, as text (tokenized and cut by the server)."""
    root = Path(__file__).resolve().parent.parent
    text = "".join(p.read_text() for p in sorted((root / "localllm").rglob("*.py")))[: args.tokens * 8]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=300).json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"tokens": ids[: args.tokens]}, timeout=300).json()["prompt"]


def one_round(args: argparse.Namespace, prompt: str | None) -> tuple[str, dict]:
    disk = tempfile.mkdtemp(prefix="restart-ttft-")
    try:
        with serve(args, disk) as url:
            prompt = prompt or prompt_text(args, url)
            cold, hit = ask(url, prompt), ask(url, prompt)
        with serve(args, disk) as url:
            restored, hit2 = ask(url, prompt), ask(url, prompt)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return prompt, {"cold": cold, "memory": hit, "disk": restored, "memory_after": hit2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompt, rounds = None, []
    for i in range(args.rounds):
        prompt, runs = one_round(args, prompt)
        rounds.append(runs)
        row = {k: {"ttft": round(r["ttft"], 3), "cached": r["cached"]} for k, r in runs.items()}
        print(f"round {i + 1}: prompt {runs['cold']['prompt_tokens']} tokens", json.dumps(row), flush=True)
    with serve(args, None) as url:
        plain = ask(url, prompt)
    report(rounds, plain)


def report(rounds: list[dict], plain: dict) -> None:
    med = {k: statistics.median(r[k]["ttft"] for r in rounds) for k in rounds[0]}
    disk_vs_mem = [r["disk"]["ttft"] / r["memory"]["ttft"] for r in rounds]
    cold_vs_disk = [r["cold"]["ttft"] / r["disk"]["ttft"] for r in rounds]
    print("median TTFT (s): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"disk hit / memory hit: {', '.join(f'{x:.2f}x' for x in disk_vs_mem)} (target <= 1.5x)")
    print(f"cold / disk hit: {', '.join(f'{x:.1f}x' for x in cold_vs_disk)} (target >= 10x)")
    same = all(r[k]["tokens"] == plain["tokens"] and r[k]["lp"] == plain["lp"] for r in rounds for k in r)
    print(f"tokens and top-5 logprobs identical to a server without the disk tier: {same}")


if __name__ == "__main__":
    main()
