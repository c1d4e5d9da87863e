"""The test server harness: a real uvicorn server on a free port around an engine factory, and the
request helpers the server, structured-output, grammar and web-page tests share."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.server.app import PoolLimits, ServedModel, ServerConfig, ServerState, create_app
from localllm.server.runner import make_server

MODEL_ID = "tiny-llama"
BAN_END = {"0": -100, "1": -100, "2": -100}  # the tiny model's special tokens: never end early
CHAT = [{"role": "user", "content": "hello there, how are you today?"}]


def engine_factory(path: Path, index_dir: Path, backend: str = "numpy", **kw: Any) -> Callable[[], LLMEngine]:
    kw.setdefault("max_num_seqs", 8)
    config = EngineConfig(model=str(path), backend=backend, index_dir=index_dir, threads=1, **kw)
    return lambda: LLMEngine(config)


class SlowEngine(LLMEngine):
    """Steps take at least `delay` seconds, so a test can act while a request is surely running."""

    delay = 0.01

    def step(self):  # type: ignore[no-untyped-def]
        time.sleep(self.delay)
        return super().step()


def slow_factory(path: Path, index_dir: Path, **kw: Any) -> Callable[[], LLMEngine]:
    kw.setdefault("max_num_seqs", 4)
    config = EngineConfig(model=str(path), backend="numpy", index_dir=index_dir, threads=1, **kw)
    return lambda: SlowEngine(config)


@dataclass
class Running:
    url: str
    state: ServerState
    server: uvicorn.Server
    pool: Any = None  # model_pool.ModelPool: the served models

    @property
    def engine(self) -> LLMEngine:
        return self.state.llm

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def wait_ready(self, timeout: float = 300) -> None:
        """Loading a real model on a machine whose kernel cache is cold compiles for a minute or more."""
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 5) -> None:
        """Until no request is queued or running and every KV block is free."""
        bm = self.engine.block_manager
        deadline = time.monotonic() + timeout
        while (
            self.state.engine.num_running
            or self.state.engine.num_waiting
            or bm.num_free_blocks != bm.num_blocks
        ):
            assert time.monotonic() < deadline, f"not idle: {bm.num_free_blocks}/{bm.num_blocks} blocks free"
            time.sleep(0.01)


@contextmanager
def running_server(
    factory: Callable[[], LLMEngine] | None,
    wait: bool = True,
    models: Sequence[ServedModel] = (),
    pool: PoolLimits | None = None,
    **config: Any,
) -> Iterator[Running]:
    """uvicorn in a thread on a loopback socket bound here (no free-port race); with `models`, a server
    of several (each loaded on demand within `pool`)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = config.pop("limits", None)
    server_config = ServerConfig(model_id=config.pop("model_id", MODEL_ID), port=port, **config)
    app = create_app(factory, server_config, models, pool)
    server = make_server(app, "127.0.0.1", port, limits, log_level="warning")  # as `localllm serve` runs
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn failed to start"
        time.sleep(0.01)
    running = Running(f"http://127.0.0.1:{port}", app.state.server, server, app.state.pool)
    try:
        if wait:
            running.wait_ready()
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, checking OpenAI's framing on the way."""
    assert body.endswith("data: [DONE]\n\n")
    blocks = body.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    payloads = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "\n" not in block
        payloads.append(json.loads(block[len("data: ") :]))
    return payloads


def post(srv: Running, path: str, body: Any, **kw: Any) -> httpx.Response:
    kw.setdefault("timeout", 60)
    if isinstance(body, str | bytes):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(srv.url + path, json=body, **kw)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def scrape(url: str) -> dict[str, float]:
    """A Prometheus scrape of `url`/metrics parsed by prometheus_client's own parser, keyed
    `name{label="value",...}` (labels sorted, model_name left out: every sample carries it)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
