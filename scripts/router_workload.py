"""Prefix-aware routing against round robin, in one run: N `localllm serve` replicas behind vllm-router,
C clients each continuing their own conversation (one shared system prompt, a growing history), all C
at once, each phase under one router policy on the same replicas, the policies alternating for
--rounds rounds.

    python scripts/router_workload.py MODEL [--replicas 3] [--threads 1] [--clients 24] [--turns 6]
        [--policies sticky_least_loaded,round_robin] [--rounds 2] [--max-tokens 48] [--system-words 800]
        [--user-words 16] [--router-args "..."] [--base-port 8300]

Per phase: the prefix-cache hit ratio across the replicas (the sum of vllm:prefix_cache_hits over the
sum of vllm:prefix_cache_queries, scraped from each replica's /metrics before and after), the requests
each replica served, the clients' time to first token (p50, p90; streamed, measured at the client from
sending the request to the first content token, through the router), and where the missed prompt tokens
were (`usage.prompt_tokens_details.cached_tokens` of each reply): on first turns (the system prompt
not yet on that replica), on later turns, and of those `history_missed`: tokens of the conversation's
previous prompt that the serving replica did not have (routing moved the conversation, or eviction).
Each phase has its own system prompt and conversations, so no phase finds another's blocks. Each client
sends its conversation's X-Session-ID header (sticky_least_loaded and consistent_hash key on it;
round_robin and cache_aware ignore it). Prints one JSON line per phase, then one per policy over its
phases (TTFTs pooled, counters summed) and the p50 TTFT ratios to the first policy's.
The replicas run with --kv-disk-mb 0 (the memory prefix cache only).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

WORDS = (
    "river stone lamp orbit cedar maple quartz violet harbor signal meadow copper lantern pixel garden "
    "thunder window basket canyon ember falcon glacier island jasmine kettle lemon marble nectar oyster "
    "pepper quill rocket saddle tulip umbrella velvet walnut yonder zephyr anchor bridge candle desert"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def start_replicas(args: argparse.Namespace, tmp: Path) -> list[tuple[str, subprocess.Popen]]:
    procs = []
    for i in range(args.replicas):
        port = args.base_port + i
        log = tmp / f"replica-{i}.log"
        cmd = [sys.executable, "-m", "localllm", "serve", args.model, "--port", str(port), "--threads",
               str(args.threads), "--parallel", str(args.parallel), "--ctx-size", str(args.ctx_size),
               "--kv-disk-mb", "0", "--metrics-public", "--no-webui", "--log-level", "warning"]  # fmt: skip
        procs.append(
            (
                f"http://127.0.0.1:{port}",
                subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT),
            )
        )
    for (url, proc), i in zip(procs, range(args.replicas), strict=True):
        wait_up(url + "/ready", proc, tmp / f"replica-{i}.log")
    return procs


def start_router(
    args: argparse.Namespace, workers: list[str], policy: str, tmp: Path
) -> tuple[str, subprocess.Popen]:
    router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = args.base_port + 90
    log = tmp / f"router-{policy}.log"
    extra = shlex.split(args.router_args)
    cmd = [router, "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(args.base_port + 91), "--health-check-endpoint", "/ready",
           "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", proc, log, timeout=120)
    return url, proc


def scrape(workers: list[str]) -> list[dict[str, float]]:
    """Per replica: prefix-cache hits and queries (tokens), requests served."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
             "vllm:request_success_total": "requests"}  # fmt: skip
    out = []
    for url in workers:
        counts = dict.fromkeys(names.values(), 0.0)
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for s in family.samples:
                if s.name in names:
                    counts[names[s.name]] += s.value
        out.append(counts)
    return out


def one_turn(url: str, messages: list[dict], session: str, max_tokens: int) -> dict:
    """Stream one chat turn: seconds to the first content token, the reply, its usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, parts, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-ID": session},
                      timeout=1200) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = ((chunk.get("choices") or [{}])[0]).get("delta") or {}
            if delta.get("content"):
                first = first or time.perf_counter()
                parts.append(delta["content"])
    ttft = (first or time.perf_counter()) - start
    return {"ttft": ttft, "reply": "".join(parts), "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}  # fmt: skip


def client(
    url: str, system: str, seed: int, args: argparse.Namespace, turns: list[dict], errors: list[str]
) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    previous = 0  # the conversation's previous prompt, in tokens
    for turn in range(args.turns):
        # lengths vary (a half to 1.5 times the flags'): with equal ones a replica's conversations run in
        # lockstep, all 8 finishing on one step and sending their next turns at once
        n_words, n_tokens = (rng.randint(n // 2, n * 3 // 2) for n in (args.user_words, args.max_tokens))
        messages.append({"role": "user", "content": words(rng, n_words)})
        try:
            got = one_turn(url, messages, f"s{seed}", n_tokens)
        except httpx.HTTPError as e:
            errors.append(repr(e))
            return
        turns.append(got | {"turn": turn, "previous": previous})
        previous = got["prompt"]
        messages.append({"role": "assistant", "content": got["reply"]})


def misses(turns: list[dict]) -> dict:
    """Where the missed prompt tokens were: first turns (the shared system prompt not yet on that
    replica), later turns, and of those `history_missed`: tokens of the conversation's previous prompt
    that the serving replica did not have (the conversation moved, or eviction); the rest of a later
    turn's misses are its new user message and the partial block before it."""
    later = [t for t in turns if t["turn"] > 0]
    return {
        "first_turn": sum(t["prompt"] - t["cached"] for t in turns if t["turn"] == 0),
        "later_turns": sum(t["prompt"] - t["cached"] for t in later),
        "history_missed": sum(max(t["previous"] - t["cached"], 0) for t in later),
        "prompt_tokens": sum(t["prompt"] for t in turns),
    }


def phase(args: argparse.Namespace, workers: list[str], policy: str, index: int, tmp: Path) -> dict:
    url, router = start_router(args, workers, policy, tmp)
    rng = random.Random(1000 + index)
    system = f"Phase {index}. " + words(rng, args.system_words)
    before = scrape(workers)
    turns: list[dict] = []
    errors: list[str] = []
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(url, system, 100 * index + c, args, turns, errors))
               for c in range(args.clients)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    router.terminate()
    router.wait()
    after = scrape(workers)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    return {"policy": policy, "turns": turns, "errors": len(errors), "wall_s": round(wall, 1),
            "hits": sum(d["hits"] for d in delta), "queries": sum(d["queries"] for d in delta),
            "per_replica": [int(d["requests"]) for d in delta]}  # fmt: skip


def summary(policy: str, phases: list[dict]) -> dict:
    turns = [t for p in phases for t in p["turns"]]
    ttfts = [t["ttft"] for t in turns]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [float("nan")] * 9
    hits, queries = sum(p["hits"] for p in phases), sum(p["queries"] for p in phases)
    return {
        "policy": policy, "phases": len(phases), "requests": len(turns),
        "errors": sum(p["errors"] for p in phases), "hit_ratio": round(hits / max(queries, 1), 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p90_s": round(q[8], 3),
        "ttft_p50_later_turns_s": round(statistics.median([t["ttft"] for t in turns if t["turn"]] or [0]), 3),
        "wall_s": round(sum(p["wall_s"] for p in phases), 1),
        "per_replica": [sum(col) for col in zip(*(p["per_replica"] for p in phases), strict=True)],
        "missed_tokens": misses(turns),
    }  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    numbers = {"replicas": 3, "threads": 1, "clients": 24, "turns": 6, "max-tokens": 48, "system-words": 800}
    numbers |= {"user-words": 16, "parallel": 8, "ctx-size": 4096, "rounds": 2, "base-port": 8300}
    for name, default in numbers.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--policies", default="sticky_least_loaded,round_robin")
    p.add_argument("--router-args", default="", help="more vllm-router flags, for every phase")
    return p.parse_args()


def main() -> None:
    args = parse()
    tmp = Path(tempfile.mkdtemp(prefix="router-workload-"))
    procs = start_replicas(args, tmp)
    workers = [url for url, _ in procs]
    policies = args.policies.split(",")
    results: dict[str, list[dict]] = {p: [] for p in policies}
    try:
        for r in range(args.rounds):
            for i, policy in enumerate(policies):
                results[policy].append(phase(args, workers, policy, r * len(policies) + i, tmp))
                print(json.dumps(summary(policy, results[policy][-1:]) | {"round": r}), flush=True)
    finally:
        for _, proc in procs:
            proc.terminate()
            proc.wait()
    totals = [summary(p, results[p]) for p in policies if results[p]]
    for s in totals:
        print(json.dumps(s | {"round": "all"}))
    base = totals[0]["ttft_p50_s"]
    ratios = {s["policy"]: round(s["ttft_p50_s"] / base, 2) for s in totals}
    print(json.dumps({"ttft_p50_over_" + totals[0]["policy"]: ratios, "logs": str(tmp)}))


if __name__ == "__main__":
    main()
