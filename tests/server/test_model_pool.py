"""A server of several models (model_pool.py) on three tiny random models: each loads on its first
request, /v1/models says which are loaded, idle ones unload after the keep-alive (the server's or a
request's), --max-loaded and the memory budget evict the least recently used, a request for a loading
model waits, 64 mixed concurrent requests all succeed, and an unknown model is OpenAI's 404."""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import BAN_END, error_of, post, running_server, scrape
from tiny_model import write_tiny_model

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.server.app import PoolLimits, ServedModel, ServerConfig
from localllm.server.model_pool import parse_keep_alive

NAMES = ("tiny-a", "tiny-b", "tiny-c")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("pool")
    return [write_tiny_model(folder / f"{name}.Q8_0.gguf", seed=i) for i, name in enumerate(NAMES)]


class Loads:
    """Engine factories that count their loads and can be held back (a slow load)."""

    def __init__(self, files: list[Path], index_dir: Path, delay: float = 0.0):
        self.files, self.index_dir, self.delay = files, index_dir, delay
        self.count = {name: 0 for name in NAMES}
        self.engines: dict[str, list[weakref.ref]] = {name: [] for name in NAMES}

    def factory(self, name: str, path: Path) -> Callable[[], LLMEngine]:
        config = EngineConfig(
            model=str(path), backend="numpy", index_dir=self.index_dir, threads=1, max_num_seqs=4
        )

        def make() -> LLMEngine:
            self.count[name] += 1
            time.sleep(self.delay)
            engine = LLMEngine(config)
            self.engines[name].append(weakref.ref(engine))
            return engine

        return make

    def models(self, memory: int = 0) -> list[ServedModel]:
        return [
            ServedModel(
                ServerConfig(model_id=name, model_aliases=(path.name,)), self.factory(name, path), memory
            )
            for name, path in zip(NAMES, self.files, strict=True)
        ]


def chat(srv: Any, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return post(srv, "/v1/chat/completions", {**body, "logit_bias": BAN_END, **extra})


def states(srv: Any) -> dict[str, str]:
    data = httpx.get(f"{srv.url}/v1/models").json()["data"]
    return {card["id"]: card["state"] for card in data}


def wait_for(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_parse_keep_alive() -> None:
    assert parse_keep_alive(300) == 300 and parse_keep_alive("45s") == 45 and parse_keep_alive("10m") == 600
    assert (
        parse_keep_alive("1h30m") == 5400 and parse_keep_alive("500ms") == 0.5 and parse_keep_alive("0") == 0
    )
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    for bad in ("soon", "", "5x", "m", True, None, float("nan")):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)  # type: ignore[arg-type]


def test_each_model_loads_on_its_first_request(model_files: list[Path], index_dir: Path) -> None:
    loads = Loads(model_files, index_dir)
    with running_server(None, models=loads.models(), pool=PoolLimits(keep_alive=math.inf)) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # up before any model loads
        assert states(srv) == dict.fromkeys(NAMES, "unloaded")
        assert "3 models, each loaded on its first request: tiny-a, tiny-b, tiny-c" in srv.pool.banner()
        replies = {}
        for i, name in enumerate(NAMES):
            r = chat(srv, name)
            assert r.status_code == 200, r.text
            replies[name] = r.json()["choices"][0]["message"]["content"]
            assert r.json()["model"] == name
            assert states(srv) == {n: "loaded" if j <= i else "unloaded" for j, n in enumerate(NAMES)}
        assert chat(srv, "tiny-a.Q8_0.gguf").status_code == 200  # the file name too
        assert loads.count == dict.fromkeys(NAMES, 1)
        assert len(set(replies.values())) > 1  # three different models answered
        card = httpx.get(f"{srv.url}/v1/models/tiny-b").json()
        assert card["state"] == "loaded" and card["max_model_len"] == 256
        metrics = httpx.get(f"{srv.url}/metrics").text
        for name in NAMES:  # each model's counters under its own label, once per family
            assert (
                f'localllm:request_success_total{{finished_reason="length",model_name="{name}"}}' in metrics
            )
            assert f'vllm:model_loads_total{{model_name="{name}"}} 1.0' in metrics
        types = [line for line in metrics.splitlines() if line.startswith("# TYPE")]
        assert len(types) == len(set(types))  # each family once (a scraper rejects a repeated one)


def test_unknown_model_is_404(model_files: list[Path], index_dir: Path) -> None:
    with running_server(None, models=Loads(model_files, index_dir).models(), pool=PoolLimits()) as srv:
        err = error_of(chat(srv, "gpt-4o"), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "gpt-4o" in err["message"] and "'tiny-c'" in err["message"]
        error_of(httpx.get(f"{srv.url}/v1/models/gpt-4o"), 404)
        error_of(post(srv, "/v1/embeddings", {"model": "gpt-4o", "input": "x"}), 404)
        assert states(srv) == dict.fromkeys(NAMES, "unloaded")  # nothing loaded for it
        assert error_of(chat(srv, "tiny-a", keep_alive="soon"), 400)["param"] == "keep_alive"


def test_idle_model_unloads_after_keep_alive(model_files: list[Path], index_dir: Path) -> None:
    loads = Loads(model_files, index_dir)
    with running_server(None, models=loads.models(), pool=PoolLimits(keep_alive=0.5)) as srv:
        assert chat(srv, "tiny-a").status_code == 200
        async_engine = srv.pool.members[0].state.engine
        assert states(srv)["tiny-a"] == "loaded"
        wait_for(lambda: states(srv)["tiny-a"] == "unloaded")
        # "unloaded" shows once the engine is detached; the unload counts once it is closed and dropped
        wait_for(lambda: srv.pool.members[0].unloads.get("idle", 0) >= 1)
        assert not async_engine._thread.is_alive()  # the engine's thread stopped
        del async_engine
        gc.collect()
        assert loads.engines["tiny-a"][0]() is None  # nothing holds the engine (its weights, its maps)
        assert chat(srv, "tiny-a").status_code == 200  # and it loads again when asked
        assert loads.count["tiny-a"] == 2
        assert scrape(srv.url)['localllm:model_unloads_total{reason="idle"}'] >= 1


def test_request_keep_alive(model_files: list[Path], index_dir: Path) -> None:
    with running_server(None, models=Loads(model_files, index_dir).models(), pool=PoolLimits(0.3)) as srv:
        assert chat(srv, "tiny-a", keep_alive=0).status_code == 200
        assert chat(srv, "tiny-b", keep_alive=-1).status_code == 200
        assert chat(srv, "tiny-c", keep_alive="1h").status_code == 200
        wait_for(lambda: states(srv)["tiny-a"] == "unloaded", timeout=5)
        time.sleep(1.0)  # well past the server's 0.3 s
        assert states(srv) == {"tiny-a": "unloaded", "tiny-b": "loaded", "tiny-c": "loaded"}


@pytest.mark.parametrize("limits", [PoolLimits(math.inf, max_loaded=2), PoolLimits(math.inf, max_memory=250)])
def test_third_model_evicts_the_least_recently_used(
    model_files: list[Path], index_dir: Path, limits: PoolLimits
) -> None:
    loads = Loads(model_files, index_dir)
    with running_server(None, models=loads.models(memory=100), pool=limits) as srv:  # 2 x 100 fit in 250
        for name in ("tiny-a", "tiny-b", "tiny-a", "tiny-c"):  # tiny-b is now the least recently used
            assert chat(srv, name).status_code == 200
        assert states(srv) == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "loaded"}
        assert chat(srv, "tiny-b").status_code == 200  # back, in place of tiny-a
        assert states(srv) == {"tiny-a": "unloaded", "tiny-b": "loaded", "tiny-c": "loaded"}
        assert loads.count == {"tiny-a": 1, "tiny-b": 2, "tiny-c": 1}
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'localllm:model_unloads_total{model_name="tiny-b",reason="evicted"} 1.0' in metrics


def test_requests_for_a_loading_model_wait_for_one_load(model_files: list[Path], index_dir: Path) -> None:
    loads = Loads(model_files, index_dir, delay=1.0)
    with running_server(None, models=loads.models(), pool=PoolLimits()) as srv:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(chat, srv, "tiny-b") for _ in range(4)]
            wait_for(lambda: states(srv)["tiny-b"] == "loading", timeout=5)
            assert all(f.result().status_code == 200 for f in futures)
        assert loads.count["tiny-b"] == 1  # four first requests, one load
        assert states(srv)["tiny-b"] == "loaded"


def test_a_model_that_fails_to_load_fails_its_requests_only(model_files: list[Path], index_dir: Path) -> None:
    loads = Loads(model_files, index_dir)
    models = loads.models()
    broken = ServedModel(ServerConfig(model_id="broken"), _broken_engine)
    with running_server(None, models=[*models, broken], pool=PoolLimits()) as srv:
        err = error_of(chat(srv, "broken"), 503)
        assert err["code"] == "load_failed" and "no such weights" in err["message"]
        assert chat(srv, "tiny-a").status_code == 200
        assert states(srv)["broken"] == "unloaded"


def _broken_engine() -> LLMEngine:
    raise FileNotFoundError("no such weights")


def test_mixed_load_over_three_models_has_no_failures(model_files: list[Path], index_dir: Path) -> None:
    loads = Loads(model_files, index_dir)
    limits = PoolLimits(keep_alive=0.2, max_loaded=2)  # loads, evictions and idle unloads all happen
    lock, statuses = threading.Lock(), []
    with running_server(None, models=loads.models(), pool=limits) as srv:

        def one(i: int) -> None:
            name = NAMES[(i * 7) % 3] if i % 5 else NAMES[i % 3]
            stream = i % 2 == 0
            r = chat(srv, name, stream=stream, max_tokens=2 + i % 4)
            ok = (
                r.status_code == 200
                and f'"model":"{name}"' in r.text.replace(" ", "")
                and '"error"' not in r.text
            )
            with lock:
                statuses.append((r.status_code, ok, r.text[:200]))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(64)))
        assert len(statuses) == 64
        failed = [s for s in statuses if not s[1]]
        assert failed == []
        assert sum(loads.count.values()) > 3  # models were evicted and loaded again meanwhile
        # a lease is given back just after the response's last byte: the client may be a moment earlier
        deadline = time.monotonic() + 5
        while any(m.leases for m in srv.pool.members) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.pool.in_flight() == 0 and all(m.leases == 0 for m in srv.pool.members)


def test_a_draining_server_takes_no_new_work_for_any_model(model_files: list[Path], index_dir: Path) -> None:
    with running_server(None, models=Loads(model_files, index_dir).models(), pool=PoolLimits()) as srv:
        assert chat(srv, "tiny-a").status_code == 200
        assert httpx.get(f"{srv.url}/ready").status_code == 200
        srv.pool.draining = True  # what SIGTERM and POST /admin/drain set (runner.py)
        for name in ("tiny-a", "tiny-b"):  # loaded or not
            assert error_of(chat(srv, name), 503)["code"] == "server_draining"
        assert httpx.get(f"{srv.url}/ready").status_code == 503
        assert httpx.get(f"{srv.url}/health").status_code == 200  # alive, finishing what it holds
        assert states(srv)["tiny-b"] == "unloaded"


def test_one_model_honours_only_keep_alive_forever(model_files: list[Path]) -> None:
    """A server of one model keeps it loaded while it runs: keep_alive -1 says just that; any other
    value would be ignored, so it is a 400 naming the field."""
    factory = lambda: LLMEngine(EngineConfig(model=str(model_files[0]), backend="numpy", max_num_seqs=2))  # noqa: E731
    with running_server(factory) as srv:
        name = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        assert chat(srv, name, keep_alive=-1).status_code == 200
        for value in (0, "5m", 30):
            err = error_of(chat(srv, name, keep_alive=value), 400)
            assert err["param"] == "keep_alive" and "one model" in err["message"]
