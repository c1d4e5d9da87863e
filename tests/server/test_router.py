"""Three `localllm serve` replicas on loopback behind vllm-router (PyPI), as docs/scaling.md runs them:
requests are spread (round_robin) or kept per session (consistent_hash), a killed replica's share goes to
the others, and a drained replica finishes its streams while new requests go elsewhere.

Skipped where vllm-router is not installed (.ci/run installs it; `pip install vllm-router`)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import Router, router_command, served, start_replicas, start_vllm_router, stop_all

pytestmark = pytest.mark.skipif(
    router_command("vllm-router") is None,
    reason="vllm-router is not installed (pip install vllm-router; .ci/run installs it)",
)
BAN_END = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: replies run their length


def chat(url: str, text: str, max_tokens: int = 2, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "logit_bias": BAN_END}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def stream(url: str, max_tokens: int, out: list[dict[str, Any]]) -> None:
    """One streamed chat through the router: whether it ended with [DONE], its finish reason, errors."""
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": max_tokens, "stream": True}
    seen: dict[str, Any] = {"done": False, "finish": None, "errors": 0, "status": None}
    try:
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body | {"logit_bias": BAN_END}, timeout=120
        ) as r:
            seen["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    seen["errors"] += "error" in chunk
                    for choice in chunk.get("choices", []):
                        seen["finish"] = choice.get("finish_reason") or seen["finish"]
    except httpx.HTTPError as e:  # the connection cut mid-stream: an error the client sees
        seen["errors"] += 1
        seen["exception"] = repr(e)
    out.append(seen)


def running(replica) -> float:
    from server_harness import scrape

    try:
        return scrape(replica.url).get("vllm:num_requests_running", 0.0)
    except httpx.TransportError:
        return 0.0


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def replicas(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    tmp = tmp_path_factory.mktemp("replicas")
    started = start_replicas(tiny_model_path, tmp, 3, "--parallel", "4", step_s=0.02)
    yield started
    stop_all(started)


@pytest.fixture
def router_factory(replicas, tmp_path: Path) -> Iterator:
    routers: list[Router] = []

    def make(policy: str, *flags: str) -> Router:
        routers.append(start_vllm_router([r.url for r in replicas], policy, tmp_path, *flags))
        return routers[-1]

    yield make
    for router in routers:
        router.stop()


def test_requests_are_spread_and_sessions_stay_put(replicas, router_factory) -> None:
    router = router_factory("round_robin")
    for i in range(9):
        r = chat(router.url, f"question {i}")
        assert r.status_code == 200, (r.text, router.log.read_text())
    counts = [served(r) for r in replicas]
    # round robin, a third each (the replicas' first test: their counts start at 0)
    assert counts == [3.0, 3.0, 3.0]
    router.stop()
    router = router_factory("consistent_hash")
    for session in ("alice", "bob", "carol", "dave"):
        before = [served(r) for r in replicas]
        for turn in range(3):
            r = chat(router.url, f"{session} turn {turn}", headers={"X-Session-ID": session})
            assert r.status_code == 200, r.text
        grew = [after - b for after, b in zip((served(r) for r in replicas), before, strict=True)]
        assert sorted(grew) == [0.0, 0.0, 3.0], f"session {session} was split across replicas: {grew}"


def test_sticky_least_loaded_spreads_sessions_and_keeps_each(replicas, router_factory) -> None:
    """The policy docs/scaling.md measures as the prefix-aware one for HTTP replicas: a new session goes
    to the replica with the fewest, and every later turn of it to the same one (its history cached)."""
    router = router_factory("sticky_least_loaded")
    homes = []
    for session in ("erin", "frank", "grace"):
        before = [served(r) for r in replicas]
        for turn in range(3):
            r = chat(router.url, f"{session} turn {turn}", headers={"X-Session-ID": session})
            assert r.status_code == 200, (r.text, router.log.read_text())
        grew = [after - b for after, b in zip((served(r) for r in replicas), before, strict=True)]
        assert sorted(grew) == [0.0, 0.0, 3.0], f"session {session} was split across replicas: {grew}"
        homes.append(grew.index(3.0))
    assert sorted(homes) == [0, 1, 2], f"three sessions, not one per replica: {homes}"


def open_streams(url: str, replicas: list, n: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    """n long streams through the router, one running on each of the first n replicas (round robin)."""
    results: list[dict[str, Any]] = []
    # 150 tokens at 20 ms a step: 3 s at least, so all n are running at once even on a loaded machine
    threads = [threading.Thread(target=stream, args=(url, 150, results)) for _ in range(n)]
    for t in threads:
        t.start()
    wait_for(
        lambda: all(running(r) == 1 for r in replicas), 60, "the streams did not spread over the replicas"
    )
    return threads, results


def test_drain_then_kill(replicas, router_factory) -> None:
    """A drained replica finishes its stream while new requests go to the others, then exits; a killed
    one's stream ends with an error the client sees (never a clean finish), the other stream completes,
    and every request sent afterwards succeeds on the one replica left. (Last in this module: it uses
    the replicas up.)"""
    router = router_factory("round_robin")
    base = served(replicas[0]) + served(replicas[1])  # the counts the test before left
    threads, results = open_streams(router.url, replicas, 3)
    drained = replicas[2]
    assert httpx.post(f"{drained.url}/admin/drain").status_code == 202
    for i in range(6):
        r = chat(router.url, f"while draining {i}")
        assert r.status_code == 200, (r.text, router.log.read_text())
    for t in threads:
        t.join(120)
    assert [(s["done"], s["finish"], s["errors"]) for s in results] == [(True, "length", 0)] * 3
    assert drained.proc.wait(timeout=30) == 0
    assert served(replicas[0]) + served(replicas[1]) - base == 2 + 6  # their streams and every new one

    threads, results = open_streams(router.url, replicas[:2], 2)
    victim = replicas[1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    for t in threads:
        t.join(120)
    clean = [s for s in results if s["done"] and s["finish"] == "length" and not s["errors"]]
    assert len(clean) == 1, results
    before = served(replicas[0])
    for i in range(6):
        r = chat(router.url, f"after the kill {i}")
        assert r.status_code == 200, (r.text, router.log.read_text())
    assert served(replicas[0]) - before == 6
