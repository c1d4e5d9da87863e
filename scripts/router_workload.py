"""Prefix-aware routing against round robin, in one run: N `localllm serve` replicas behind vllm-router,
C clients each continuing their own conversation (one shared system prompt, a growing history), all C
at once, each phase under one router policy on the same replicas.

    python scripts/router_workload.py MODEL [--replicas 3] [--threads 1] [--clients 24] [--turns 4]
        [--policies cache_aware,round_robin] [--max-tokens 12] [--system-words 250] [--base-port 8300]

Per phase: the prefix-cache hit ratio across the replicas (the sum of vllm:prefix_cache_hits over the
sum of vllm:prefix_cache_queries, scraped from each replica's /metrics before and after) and the
clients' time to first token (p50, p90; streamed, measured at the client, through the router). Each
phase has its own system prompt and conversations, so no phase finds the one before's blocks. Each
client sends its conversation's X-Session-ID header (consistent_hash keys on it; the other policies
ignore it). Prints one JSON line per phase and the ratios of the first phase to the last.
The replicas run with --kv-disk-mb 0 (the memory prefix cache only) and --ctx-size 4096.
"""

from __future__ import annotations

import argparse
import json
import random
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
               str(args.threads), "--parallel", str(args.parallel), "--ctx-size", "4096", "--kv-disk-mb", "0",
               "--metrics-public", "--no-webui", "--log-level", "warning"]  # fmt: skip
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
    cmd = [router, "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(args.base_port + 91), "--health-check-endpoint", "/ready",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", proc, log, timeout=120)
    return url, proc


def prefix_counts(workers: list[str]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for url in workers:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for s in family.samples:
                hits += s.value if s.name == "vllm:prefix_cache_hits_total" else 0.0
                queries += s.value if s.name == "vllm:prefix_cache_queries_total" else 0.0
    return hits, queries


def one_turn(url: str, messages: list[dict], session: str, max_tokens: int) -> tuple[float, str]:
    """Stream one chat turn; (seconds to the first content token, the reply)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, first, parts = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-ID": session},
                      timeout=600) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta") or {}
            if delta.get("content"):
                first = first or time.perf_counter()
                parts.append(delta["content"])
    return (first or time.perf_counter()) - start, "".join(parts)


def client(
    url: str, system: str, seed: int, args: argparse.Namespace, ttfts: list[float], errors: list[str]
) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    for _ in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.user_words)})
        try:
            ttft, reply = one_turn(url, messages, f"s{seed}", args.max_tokens)
        except httpx.HTTPError as e:
            errors.append(repr(e))
            return
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": reply})


def phase(args: argparse.Namespace, workers: list[str], policy: str, index: int, tmp: Path) -> dict:
    url, router = start_router(args, workers, policy, tmp)
    rng = random.Random(1000 + index)
    system = f"Phase {index}. " + words(rng, args.system_words)
    before = prefix_counts(workers)
    ttfts: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(url, system, 100 * index + c, args, ttfts, errors))
               for c in range(args.clients)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    router.terminate()
    router.wait()
    after = prefix_counts(workers)
    hits, queries = after[0] - before[0], after[1] - before[1]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [float("nan")] * 9
    return {
        "policy": policy, "requests": len(ttfts), "errors": len(errors),
        "hit_ratio": round(hits / max(queries, 1), 3), "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p90_s": round(q[8], 3), "wall_s": round(wall, 1),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    numbers = {"replicas": 3, "threads": 1, "clients": 24, "turns": 4, "max-tokens": 12, "system-words": 250}
    numbers |= {"user-words": 20, "parallel": 8, "base-port": 8300}
    for name, default in numbers.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--policies", default="cache_aware,round_robin")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="router-workload-"))
    procs = start_replicas(args, tmp)
    workers = [url for url, _ in procs]
    try:
        results = []
        for i, policy in enumerate(args.policies.split(",")):
            results.append(phase(args, workers, policy, i, tmp))
            print(json.dumps(results[-1]), flush=True)  # each phase as it ends: a long run may be cut
    finally:
        for _, proc in procs:
            proc.terminate()
            proc.wait()
    first, last = results[0], results[-1]
    print(json.dumps({"ttft_p50_ratio_last_over_first": round(last["ttft_p50_s"] / first["ttft_p50_s"], 2),
                      "hit_ratio": [first["hit_ratio"], last["hit_ratio"]], "logs": str(tmp)}))  # fmt: skip


if __name__ == "__main__":
    main()
