"""`localllm serve` as a worker behind a router: /ready, --metrics-public, and the drain (POST /admin/drain
in process, SIGTERM on a real `localllm serve`): open requests finish, new ones go elsewhere, then it exits.
vLLM's metric names are checked with the other metrics in test_server.py."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import engine_factory, running_server, slow_factory
from webui_harness import start_serve, stop_serve

from localllm.engine.engine import LLMEngine

BAN_END = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: every stream runs its length


def stream_chat(url: str, max_tokens: int, out: list[dict[str, Any]]) -> None:
    """One streamed chat request; appends what it saw: the finish reason, errors, [DONE], when it ended."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True}
    body |= {"logit_bias": BAN_END}
    seen: dict[str, Any] = {"finish": None, "errors": 0, "done": False, "chunks": 0}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                seen["errors"] += "error" in chunk
                seen["chunks"] += 1
                for choice in chunk.get("choices", []):
                    seen["finish"] = choice.get("finish_reason") or seen["finish"]
    seen["ended"] = time.monotonic()
    out.append(seen)


def open_streams(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=stream_chat, args=(url, max_tokens, results)) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def new_request_refused(url: str) -> bool:
    """A new request is not taken: its connection refused, or a 503 saying the server drains."""
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    except httpx.TransportError:
        return True
    return r.status_code == 503 and r.json()["error"]["code"] in ("server_draining", "server_shutdown")


def test_metrics_public_needs_no_key_and_ready_is_open(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(engine_factory(tiny_model_path, index_dir), api_key="k", metrics_public=True) as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        assert httpx.get(f"{srv.url}/ready").json() == {"status": "ready"}
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401  # the API itself still needs it
    with running_server(engine_factory(tiny_model_path, index_dir), api_key="k") as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 401


def test_ready_is_503_while_loading(tiny_model_path: Path, index_dir: Path) -> None:
    release = threading.Event()
    build = engine_factory(tiny_model_path, index_dir)

    def slow_load() -> LLMEngine:
        release.wait(30)
        return build()

    with running_server(slow_load, wait=False) as srv:
        for path in ("/ready", "/health"):
            r = httpx.get(f"{srv.url}{path}")
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        srv.wait_ready()
        assert httpx.get(f"{srv.url}/ready").status_code == 200


def test_admin_drain_finishes_open_streams_then_exits(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(slow_factory(tiny_model_path, index_dir)) as srv:
        threads, results = open_streams(srv.url, 4, max_tokens=24)
        wait_for(lambda: srv.state.in_flight() == 4, 30, "the streams did not start")
        r = httpx.post(f"{srv.url}/admin/drain")
        assert r.status_code == 202 and r.json() == {"status": "draining", "in_flight": 4}
        assert new_request_refused(srv.url)
        for t in threads:
            t.join(60)
        assert [(s["finish"], s["errors"], s["done"]) for s in results] == [("length", 0, True)] * 4
        wait_for(lambda: srv.server.should_exit, 5, "the drained server did not exit")


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="no SIGTERM on this platform")
def test_sigterm_drains_open_streams(tiny_model_path: Path, tmp_path: Path) -> None:
    """Eight streams open when SIGTERM arrives: all complete, no new request is taken, and the process
    exits within a second of the last one."""
    serve = start_serve(tiny_model_path, tmp_path, "--parallel", "8", step_s=0.05)
    try:
        threads, results = open_streams(serve.url, 8, max_tokens=100)
        wait_for(lambda: _running(serve.url) == 8, 60, "the streams did not start")
        serve.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert new_request_refused(serve.url)
        for t in threads:
            t.join(120)
        assert [(s["finish"], s["errors"], s["done"]) for s in results] == [("length", 0, True)] * 8
        serve.proc.wait(timeout=30)
        exited = time.monotonic()
        assert exited - max(s["ended"] for s in results) < 1.0
        assert serve.proc.returncode == 0, serve.log.read_text()
    finally:
        if serve.proc.poll() is None:
            stop_serve(serve)


def _running(url: str) -> float:
    from server_harness import scrape

    return scrape(url).get("localllm:num_requests_running", 0.0)
