"""Load on the real `localllm serve` process (tiny model, numpy, loopback only): 200 requests at
concurrency 32, mixed chat/completions, streaming or not, of varied lengths, with 10% of clients
disconnecting mid-stream. Every other request must complete exactly as it does alone, nothing may be
a 5xx, the KV pool must be entirely free afterwards, and the server's RSS must not grow across a second
identical round. Ends with SIGTERM and checks the graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_harness import scrape

REQUESTS = 200
CONCURRENCY = 32
DISCONNECT_EVERY = 10  # 10% of the clients hang up mid-stream
BAN_END = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: lengths stay exact
WORDS = "the quick brown fox jumps over a lazy dog while seven tiny models hum along".split()


@dataclass(frozen=True)
class Shape:
    kind: str  # "chat" | "completion"
    prompt: str
    max_tokens: int

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0, "logit_bias": BAN_END}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def shapes(n: int = 12, seed: int = 0) -> list[Shape]:
    rng = random.Random(seed)
    return [
        Shape(
            rng.choice(["chat", "completion"]),
            " ".join(rng.choices(WORDS, k=rng.randint(1, 24))),
            rng.randint(1, 64),
        )
        for _ in range(n)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """`localllm serve` as its own process, as an operator would run it."""
    home = tmp_path_factory.mktemp("home")
    port = free_port()
    log_path = home / "server.log"
    code = "import localllm.cli.serve; from localllm.cli import main; main()"
    args = ["serve", str(tiny_model_path), "--backend", "numpy", "--threads", "1", "--port", str(port)]
    args += ["--parallel", "8", "--max-queue", "0"]
    env = {**os.environ, "LOCALLLM_HOME": str(home)}
    env.pop("LOCALLLM_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during startup"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


# ------------------------------------------------------------------------------------------------ clients


def stream_text(raw: str) -> tuple[str, dict[str, Any], str | None]:
    """Text, usage and finish_reason of an SSE body, checking OpenAI's framing."""
    assert raw.endswith("data: [DONE]\n\n")
    payloads = [json.loads(b[len("data: ") :]) for b in raw.split("\n\n")[:-2]]
    text, finish = "", None
    for p in payloads[:-1]:
        choice = p["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        finish = choice["finish_reason"] or finish
    return text, payloads[-1]["usage"], finish


async def complete(client: httpx.AsyncClient, shape: Shape, stream: bool) -> dict[str, Any]:
    r = await client.post(shape.path, json=shape.body(stream))
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text}
    if stream:
        text, usage, finish = stream_text(r.text)
    else:
        data = r.json()
        choice, usage = data["choices"][0], data["usage"]
        text, finish = (
            choice.get("text", (choice.get("message") or {}).get("content")),
            choice["finish_reason"],
        )
    return {"status": 200, "text": text, "tokens": usage["completion_tokens"], "finish": finish}


async def hang_up(client: httpx.AsyncClient, shape: Shape) -> dict[str, Any]:
    body = shape.body(True) | {"ignore_eos": True}
    del body["max_tokens"]  # run until the context is full unless the hang-up stops it
    async with client.stream("POST", shape.path, json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream
    return {"status": 200, "hung_up": True}


async def run_round(url: str, plan: list[tuple[int, bool]], all_shapes: list[Shape]) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:

        async def one(i: int, shape_index: int, stream: bool) -> dict[str, Any]:
            async with sem:
                shape = all_shapes[shape_index]
                if i % DISCONNECT_EVERY == DISCONNECT_EVERY - 1:
                    return await hang_up(client, shape)
                return {**await complete(client, shape, stream), "shape": shape_index}

        return await asyncio.gather(*(one(i, s, st) for i, (s, st) in enumerate(plan)))


# ------------------------------------------------------------------------------------------------ checks


def metric_values(url: str) -> dict[str, float]:
    return scrape(url)


def wait_drained(url: str, timeout: float = 10) -> dict[str, float]:
    """Nothing running or waiting and the KV pool entirely free (usage is 1 - free/total, so exactly 0)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(url)
        idle = m["localllm:num_requests_running"] == m["localllm:num_requests_waiting"] == 0
        if idle and m["localllm:kv_cache_usage_perc"] == 0.0:
            return m
        assert time.monotonic() < deadline, f"not drained: {m}"
        time.sleep(0.05)


def check_round(results: list[dict[str, Any]], expected: dict[int, str], all_shapes: list[Shape]) -> None:
    assert len(results) == REQUESTS
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    done = [r for r in results if not r.get("hung_up")]
    assert len(done) == REQUESTS - REQUESTS // DISCONNECT_EVERY
    for r in done:
        shape = all_shapes[r["shape"]]
        assert r["finish"] == "length" and r["tokens"] == shape.max_tokens
        assert r["text"] == expected[r["shape"]], "batched output differs from the output alone"


def test_load_two_rounds(server) -> None:
    url, proc, log_path = server
    all_shapes = shapes()
    rng = random.Random(1)
    plan = [(rng.randrange(len(all_shapes)), rng.random() < 0.5) for _ in range(REQUESTS)]

    async def alone() -> dict[int, str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            results = [await complete(client, s, False) for s in all_shapes]
        assert all(r["status"] == 200 for r in results), results
        return {i: r["text"] for i, r in enumerate(results)}

    expected = asyncio.run(alone())
    rss = []
    for _ in range(2):
        started = time.monotonic()
        results = asyncio.run(run_round(url, plan, all_shapes))
        check_round(results, expected, all_shapes)
        wait_drained(url)
        rss.append(psutil.Process(proc.pid).memory_info().rss)
        print(f"round: {time.monotonic() - started:.1f} s, server RSS {rss[-1] / 2**20:.0f} MiB")
    growth = rss[1] - rss[0]
    assert growth < max(32 * 2**20, rss[0] * 0.1), f"RSS grew by {growth / 2**20:.1f} MiB"
    m = metric_values(url)
    assert (
        m['localllm:request_success_total{finished_reason="abort"}'] >= 2 * REQUESTS // DISCONNECT_EVERY * 0.5
    )

    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    log = log_path.read_text()
    assert "localllm serving" in log and "KV cache" in log  # the banner
    assert "Application shutdown complete" in log
