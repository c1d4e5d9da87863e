"""Routers from PyPI in front of `localllm serve` replicas: find the router's command, start it on a
loopback port in front of given worker URLs, and tell which replica served what (from their /metrics)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from server_harness import scrape
from webui_harness import Serve, free_port, start_serve

SERVED = "vllm:request_success_total"  # summed over finished_reason: requests a replica completed


def router_command(name: str) -> list[str] | None:
    """How to run vllm-router (its console script, next to this Python or on PATH); None if absent."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    return [found] if found else None


@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_vllm_router(workers: list[str], policy: str, tmp: Path, *flags: str) -> Router:
    """vllm-router on a free loopback port; it checks /ready every second, so a draining or dead
    replica leaves the rotation."""
    command = router_command("vllm-router")
    assert command is not None
    port = free_port()
    args = [*command, "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1"]
    args += ["--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warning"]
    args += ["--health-check-endpoint", "/ready", "--health-check-interval-secs", "1", *flags]
    log = tmp / f"router-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    router = Router(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 60
    while not _up(router.url + "/health"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return router


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def start_replicas(model: Path, tmp: Path, n: int, *flags: str, step_s: float = 0.02) -> list[Serve]:
    """n `localllm serve` processes (numpy backend, 1 thread each), started side by side."""
    out: list[Serve | BaseException] = [RuntimeError("not started")] * n

    def start(i: int) -> None:
        try:
            out[i] = start_serve(model, tmp / f"r{i}", "--metrics-public", *flags, step_s=step_s)
        except BaseException as e:  # reported below, after the others are stopped
            out[i] = e

    for i in range(n):
        (tmp / f"r{i}").mkdir(exist_ok=True)
    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in out if isinstance(e, BaseException)]
    if failed:
        stop_all([s for s in out if isinstance(s, Serve)])
        raise failed[0]
    return out  # type: ignore[return-value]


def stop_all(replicas: list[Serve]) -> None:
    for s in replicas:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def served(replica: Serve) -> float:
    """Requests this replica has completed (0 once it is gone)."""
    try:
        metrics = scrape(replica.url)
    except httpx.TransportError:
        return 0.0
    return sum(v for k, v in metrics.items() if k.startswith(SERVED))
