"""Several registry models behind one `localllm serve` (issue 31, item 5), measured on the real CLI:

    python scripts/bench_model_pool.py --threads 2

1. The first request to each model loads it: the request's wall time and the server's load time
   (`localllm:model_load_seconds`), with a memory budget (--max-memory-mb) that fits the two largest
   models, so the third load evicts the least recently used one.
2. 64 completion requests spread over the three models, 8 at a time (streamed or not): failures, loads and
   evictions meanwhile, wall time.
3. Idle: every model unloads within the keep-alive (plus the reaper's tick); the server's RSS with
   none, two, and again none loaded.

Prints one JSON object (and a few readable lines on stderr).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil

MODELS = ("smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-0.5b-instruct")


def estimates(ctx: int, parallel: int) -> dict[str, int]:
    """Each model's memory estimate, as `serve` computes it for the budget."""
    from localllm.cli.common import model_home
    from localllm.cli.serve_models import memory_estimate
    from localllm.config import DEFAULT_CONTEXT
    from localllm.registry import default_user_registry, load_registry, models_dir

    registry, home = load_registry(default_user_registry()), model_home()
    config = SimpleNamespace(
        index_dir=home / "index",
        ctx_size=ctx,
        max_default_ctx=DEFAULT_CONTEXT,
        kv_cache_mb=0,
        max_num_seqs=parallel,
    )
    out = {}
    for name in MODELS:
        entry = registry.find(name)
        assert entry is not None, name
        out[name] = memory_estimate(models_dir(home) / entry.file_name, config)
    return out


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name.startswith("localllm:model_"):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def states(url: str) -> dict[str, str]:
    return {c["id"]: c["state"] for c in httpx.get(f"{url}/v1/models").json()["data"]}


def complete(url: str, model: str, stream: bool = False, max_tokens: int = 16) -> tuple[bool, float, str]:
    """One /v1/completions request (gemma-3-270m, a base model, has no chat template)."""
    body = {
        "model": model,
        "prompt": "The three primary colours are",
        "max_tokens": max_tokens,
        "stream": stream,
    }
    start = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    except httpx.HTTPError as e:
        return False, time.perf_counter() - start, repr(e)
    ok = r.status_code == 200 and '"error"' not in r.text and (not stream or r.text.endswith("[DONE]\n\n"))
    return ok, time.perf_counter() - start, "" if ok else f"{r.status_code} {r.text[:200]}"


def first_requests(url: str) -> list[dict[str, Any]]:
    rows = []
    for name in MODELS:
        ok, seconds, error = complete(url, name)
        m = metrics(url)
        rows.append(
            {
                "model": name,
                "ok": ok,
                "first_request_s": round(seconds, 2),
                "load_s": round(m.get(f"localllm:model_load_seconds{{model_name={name}}}", -1), 2),
                "states_after": states(url),
                "error": error,
            }
        )
        print(f"first request to {name}: {seconds:.2f} s, states {rows[-1]['states_after']}", file=sys.stderr)
    return rows


def mixed(url: str, count: int, concurrency: int) -> dict[str, Any]:
    before = metrics(url)
    plan = [(MODELS[(i * 7 + i // 5) % 3], i % 2 == 0) for i in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: complete(url, p[0], p[1]), plan))
    wall = time.perf_counter() - start
    after = metrics(url)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if "loads" in k or "unloads" in k}
    return {
        "requests": count,
        "failed": sum(not ok for ok, _, _ in results),
        "errors": [e for ok, _, e in results if not ok][:5],
        "wall_s": round(wall, 1),
        "slowest_s": round(max(s for _, s, _ in results), 1),
        "loads_and_unloads": {k: v for k, v in delta.items() if v},
    }


def idle(url: str, keep_alive: float) -> dict[str, Any]:
    start = time.perf_counter()
    while any(s != "unloaded" for s in states(url).values()):
        if time.perf_counter() - start > keep_alive + 60:
            break
        time.sleep(0.2)
    return {"all_unloaded_after_s": round(time.perf_counter() - start, 1), "states": states(url)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--keep-alive", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    need = estimates(args.ctx_size, args.parallel)
    budget_mb = (sum(sorted(need.values())[-2:]) >> 20) + 1  # the two largest fit, never all three
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "localllm",
        "serve",
        *MODELS,
        "--port",
        str(port),
        "--threads",
        str(args.threads),
    ]
    cmd += ["--ctx-size", str(args.ctx_size), "--parallel", str(args.parallel), "--kv-disk-mb", "0"]
    cmd += ["--keep-alive", f"{args.keep_alive:g}", "--max-memory-mb", str(budget_mb), "--no-webui"]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, Path(log.name).read_text()
            time.sleep(0.2)
        rss = lambda: psutil.Process(proc.pid).memory_info().rss >> 20  # noqa: E731
        result: dict[str, Any] = {"command": " ".join(cmd[2:]), "rss_mib_none_loaded": rss()}
        result |= {"estimates_mib": {k: v >> 20 for k, v in need.items()}, "budget_mib": budget_mb}
        result["first_requests"] = first_requests(url)
        result["rss_mib_two_loaded"] = rss()
        result["mixed"] = mixed(url, args.requests, args.concurrency)
        result["idle"] = idle(url, args.keep_alive)
        result["rss_mib_after_idle_unload"] = rss()
        result["server_log"] = log.name
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
