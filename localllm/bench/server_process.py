"""A `localllm serve` child process for `bench serve`: its command line, a free loopback port, waiting
for /health, and stopping it."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(
    model: Path, port: int, backend: str, threads: int, parallel: int, ctx_size: int, extra: list[str]
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "localllm",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend",
        backend,
        "--parallel",
        str(parallel),
        "--log-level",
        "warning",
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    if ctx_size:
        cmd += ["--ctx-size", str(ctx_size)]
    return cmd + extra


@contextmanager
def local_server(cmd_for_port: Any, startup_timeout: float = 900.0) -> Iterator[str]:
    """Start `cmd_for_port(port)` on a free loopback port, wait for /health 200, stop it on exit."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd_for_port(port), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, log, startup_timeout)
            yield url
        finally:
            _stop(proc)


def wait_healthy(url: str, proc: subprocess.Popen, log: Any, timeout: float) -> None:
    """Poll /health (503 while loading) until it answers 200; fail early if the server exits."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise LocalLLMError(f"the server exited with status {proc.returncode}: {' | '.join(tail)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise LocalLLMError(f"the server did not become healthy within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
