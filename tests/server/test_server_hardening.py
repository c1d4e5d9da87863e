"""`localllm serve` against hostile or careless clients: slow sockets, floods of connections, huge
bodies and prompts, cross-site browser requests, DNS rebinding, missing keys, SIGTERM mid-stream and
bad flags. In-process servers for the protocol cases; the real `run_server` in a subprocess where the
process matters (descriptor limits, signals, the log)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_ID, Running, engine_factory, error_of, post, running_server, slow_factory

from localllm.server.connections import ConnectionLimits
from localllm.server.logs import RateLimitFilter

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    limits = ConnectionLimits(max_connections=64, header_timeout=1.0, body_timeout=1.0)
    with running_server(engine_factory(tiny_model_path, index_dir), limits=limits) as running:
        yield running


def raw_socket(srv: Running) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------------------------- slow clients


def test_slow_headers_are_cut(srv: Running) -> None:
    idle = raw_socket(srv)  # sends nothing at all
    trickle = raw_socket(srv)
    trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends its headers
    assert closed_by_server(idle, 4) and closed_by_server(trickle, 4)


def test_slow_body_is_cut(srv: Running) -> None:
    sock = raw_socket(srv)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
    assert closed_by_server(sock, 4)


def test_connection_limit_closes_idle_sockets_first(srv: Running) -> None:
    socks = [raw_socket(srv) for _ in range(100)]  # over the limit of 64: the oldest idle ones make room
    try:
        started = time.monotonic()
        assert post(srv, "/v1/chat/completions", CHAT).status_code == 200
        assert time.monotonic() - started < 2
        assert closed_by_server(socks[0], 2)
    finally:
        for s in socks:
            s.close()


def test_connection_limit_refuses_when_all_are_busy(tiny_model_path: Path, index_dir: Path) -> None:
    limits = ConnectionLimits(max_connections=2)
    body = {"prompt": "busy", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with running_server(slow_factory(tiny_model_path, index_dir), limits=limits) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as a:
            lines_a = a.iter_lines()
            next(lines_a)
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as b:
                lines_b = b.iter_lines()
                next(lines_b)
                refused = httpx.get(f"{srv.url}/v1/models")
                assert error_of(refused, 503)["code"] == "too_many_connections"
                assert refused.headers["retry-after"] == "1"


# --------------------------------------------------------------------------------- bodies and prompts


def test_huge_body_is_413_at_once(srv: Running) -> None:
    body = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    started = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - started
    assert error_of(r, 413)["code"] == "request_too_large"
    assert elapsed < 1.0, elapsed  # ~20 ms on a quiet machine: no body parsing, no tokenizing


def test_huge_chunked_body_is_413(srv: Running) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1_000_000
        yield b'"}'

    r = httpx.post(
        f"{srv.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert error_of(r, 413)["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_overlong_prompt_refused_before_tokenizing(srv: Running, path: str) -> None:
    text = "word " * 200_000  # 1 MB: far more than 256 tokens whatever the tokenizer
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    tokenize = srv.engine.tokenizer.encode
    calls = []
    srv.engine.tokenizer.encode = lambda *a, **k: calls.append(1) or tokenize(*a, **k)  # type: ignore[method-assign]
    try:
        err = error_of(post(srv, path, body), 400)
    finally:
        del srv.engine.tokenizer.encode
    assert err["code"] == "context_length_exceeded" and not calls
    assert err["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested"
    )


def test_prompt_under_the_bound_gets_the_exact_check(srv: Running) -> None:
    err = error_of(post(srv, "/v1/completions", {"prompt": "hello " * 300, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded" and "at least" not in err["message"]


# ------------------------------------------------------------------------------------ browsers, hosts


def test_cross_site_browser_requests_are_403(srv: Running) -> None:
    plain = {"content-type": "text/plain"}
    body = json.dumps(CHAT)
    drive_by = httpx.post(
        f"{srv.url}/v1/chat/completions", content=body, headers={**plain, "origin": "http://evil.example"}
    )
    assert error_of(drive_by, 403)["code"] == "origin_not_allowed"
    fetch = httpx.post(
        f"{srv.url}/v1/chat/completions", content=body, headers={**plain, "sec-fetch-site": "cross-site"}
    )
    assert error_of(fetch, 403)["code"] == "origin_not_allowed"
    # a program (curl -d, no Origin) keeps working whatever its content type; so does the UI at /docs
    assert httpx.post(f"{srv.url}/v1/chat/completions", content=body, headers=plain).status_code == 200
    same = httpx.post(f"{srv.url}/v1/chat/completions", content=body, headers={**plain, "origin": srv.url})
    assert same.status_code == 200


def test_a_link_from_another_site_opens_the_page_but_posts_stay_refused(srv: Running) -> None:
    nav = {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}
    assert httpx.get(f"{srv.url}/", headers=nav).status_code == 200
    posted = httpx.post(f"{srv.url}/v1/chat/completions", content=json.dumps(CHAT), headers=nav)
    assert error_of(posted, 403)["code"] == "origin_not_allowed"


def test_dns_rebinding_host_is_403(srv: Running) -> None:
    port = srv.url.rsplit(":", 1)[1]
    rebound = httpx.get(f"{srv.url}/v1/models", headers={"host": f"evil.example:{port}"})
    assert error_of(rebound, 403)["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"app.localhost:{port}"):
        assert httpx.get(f"{srv.url}/v1/models", headers={"host": host}).status_code == 200


def test_allowed_origins_and_hosts(tiny_model_path: Path, index_dir: Path) -> None:
    factory = engine_factory(tiny_model_path, index_dir)
    with running_server(factory, cors_origins=("http://app.example",), allowed_hosts=("box.lan",)) as srv:
        ok = httpx.get(f"{srv.url}/v1/models", headers={"origin": "http://app.example", "host": "box.lan"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.get(f"{srv.url}/v1/models", headers={"origin": "http://other.example"})
        assert error_of(other, 403)["code"] == "origin_not_allowed"


def test_api_key_guards_everything_but_health(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(engine_factory(tiny_model_path, index_dir), api_key="k") as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
            assert error_of(httpx.get(srv.url + path), 401)["code"] == "invalid_api_key", path
        assert error_of(post(srv, "/tokenize", {"prompt": "x"}), 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/metrics", headers={"authorization": "Bearer k"}).status_code == 200
        r = srv.client(api_key="k").chat.completions.create(
            model=MODEL_ID, messages=CHAT["messages"], max_tokens=1
        )
        assert r.choices[0].message.content is not None


# ---------------------------------------------------------------------------------------------- logs


def test_rate_limited_log_has_no_tracebacks() -> None:
    f = RateLimitFilter(interval=60)
    passed = []
    for _ in range(1000):
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            record = logging.LogRecord("x", logging.ERROR, __file__, 1, "socket error", None, sys.exc_info())
        if f.filter(record):
            passed.append(record)
    assert len(passed) == 1 and passed[0].exc_info is None and "reset by peer" in passed[0].getMessage()
    info = logging.LogRecord("x", logging.INFO, __file__, 1, "request %s done", ("a",), None)
    assert all(f.filter(info) for _ in range(5))  # the per-request line is never limited


# ------------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "args",
    [["--port", "99999"], ["--port", "-1"], ["--threads", "-2"], ["--parallel", "0"], ["--max-body-mb", "0"]],
)
def test_bad_flag_values_exit_2_with_one_line(args: list[str]) -> None:
    code = "import localllm.cli.serve; from localllm.cli import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", code, "serve", "no-such-model.gguf", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {args[0]} must be"), r.stderr


# --------------------------------------------------------------------------- the process: floods, SIGTERM

SERVER = """
import sys, time, json
from pathlib import Path
from localllm.cli.serve import run_server
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.server.app import ServerConfig
from localllm.server.connections import ConnectionLimits

class Slow(LLMEngine):
    def step(self):
        time.sleep(float(sys.argv[4]))
        return super().step()

cfg = EngineConfig(model=sys.argv[1], backend="numpy", threads=1, index_dir=Path(sys.argv[3]), max_num_seqs=8)
limits = ConnectionLimits(**json.loads(sys.argv[5]))
config = ServerConfig(model_id="tiny", port=int(sys.argv[2]), drain_timeout=0)  # SIGTERM: at once
run_server(lambda: Slow(cfg), config, "info", limits)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, index_dir: Path, log: Path, step_s: float = 0.0, **limits: Any
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [str(model), str(port), str(index_dir), str(step_s), json.dumps(limits)]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, *args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the server did not become ready")


def raise_own_fd_limit(need: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the open-file limit ({hard}) is too low for this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


async def hold_slow_sockets(port: int, count: int, seconds: float) -> None:
    """`count` slowloris clients: each opens, then sends one header byte a second, never finishing."""

    async def one() -> None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(int(seconds)):
                await asyncio.sleep(1)
                writer.write(b"X")
            writer.close()
        except OSError:
            pass  # closed by the server: what it should do

    await asyncio.gather(*(one() for _ in range(count)))


def slowloris(tiny_model_path: Path, index_dir: Path, tmp_path: Path, count: int) -> tuple[float, int]:
    """(seconds a normal request took while `count` slow sockets were open, log lines)."""
    raise_own_fd_limit(count + 512)
    log = tmp_path / "server.log"
    proc, url = start_server(tiny_model_path, index_dir, log)
    try:
        port = int(url.rsplit(":", 1)[1])
        holders = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(count), "12"])
        time.sleep(4)  # all connected and trickling
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        took = time.monotonic() - started
        assert r.status_code == 200, r.text
        holders.wait(timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    return took, len(log.read_text().splitlines())


HOLDER = f"""
import asyncio, logging, resource, sys
logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # writes after the server hung up: expected
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
{__import__("inspect").getsource(hold_slow_sockets)}
asyncio.run(hold_slow_sockets(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
"""


def test_slowloris_500(tiny_model_path: Path, index_dir: Path, tmp_path: Path) -> None:
    took, lines = slowloris(tiny_model_path, index_dir, tmp_path, 500)
    assert took < 2 and lines < 100, (took, lines)


@pytest.mark.slow
def test_slowloris_2000(tiny_model_path: Path, index_dir: Path, tmp_path: Path) -> None:
    took, lines = slowloris(tiny_model_path, index_dir, tmp_path, 2000)
    print(f"2000 slow sockets: a request took {took * 1000:.0f} ms; {lines} log lines")
    assert took < 2 and lines < 100, (took, lines)


async def open_streams(url: str, count: int, started: asyncio.Event) -> list[str]:
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True, "ignore_eos": True}
    ready = 0

    async def one(client: httpx.AsyncClient) -> str:
        nonlocal ready
        text = ""
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_text():
                if not text:
                    ready += 1
                    if ready == count:
                        started.set()
                text += chunk
        return text

    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(one(client) for _ in range(count)))


def test_sigterm_ends_32_streams_with_an_error_event(
    tiny_model_path: Path, index_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    proc, url = start_server(tiny_model_path, index_dir, log, step_s=0.05)

    async def run() -> tuple[list[str], float]:
        started = asyncio.Event()
        streams = asyncio.ensure_future(open_streams(url, 32, started))
        await asyncio.wait_for(started.wait(), 30)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        bodies = await streams
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 15)
        return bodies, time.monotonic() - t0

    bodies, took = asyncio.run(run())
    for body in bodies:
        assert body.endswith("data: [DONE]\n\n")
        last = json.loads(body.split("\n\n")[-3].removeprefix("data: "))
        assert last["error"]["code"] == "server_shutdown"
    text = log.read_text()
    assert took < 10 and "Traceback" not in text, (took, text[-3000:])
    print(f"SIGTERM with 32 streams: exited after {took:.2f} s")


def test_embeddings_stop_when_the_client_leaves(srv: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big embeddings request runs one forward pass per engine call; once its client is gone no
    further pass starts (it used to keep the engine busy for minutes)."""
    import localllm.server.embeddings as embeddings

    calls: list[int] = []
    real = embeddings.embed_token_ids

    def slow(engine: Any, group: list[list[int]]) -> Any:
        calls.append(len(group))
        time.sleep(0.2)
        return real(engine, group)

    monkeypatch.setattr(embeddings, "embed_token_ids", slow)
    body = {"model": MODEL_ID, "input": [[7] * 200 for _ in range(60)]}  # passes of 2 inputs
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/embeddings", json=body, timeout=1.0)
    time.sleep(0.6)
    seen = len(calls)
    time.sleep(1.0)
    assert len(calls) == seen and seen < 12, calls
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert r.status_code == 200


def test_embeddings_past_the_token_budget_are_refused(tiny_model_path: Path, index_dir: Path) -> None:
    factory = engine_factory(tiny_model_path, index_dir)
    with running_server(factory, max_embedding_tokens=1000) as small:
        err = error_of(post(small, "/v1/embeddings", {"input": [[7] * 200] * 6}), 400)
        assert err["param"] == "input" and "1,000 tokens" in err["message"]
        assert post(small, "/v1/embeddings", {"input": [[7] * 200] * 5}).status_code == 200


MALFORMED_TURNS = [
    ("/v1/chat/completions", {"role": "assistant", "content": "x", "tool_calls": 5}),
    ("/v1/chat/completions", {"role": "assistant", "content": "x", "tool_calls": [5]}),
    ("/v1/chat/completions", {"role": "assistant", "content": "x", "tool_calls": [{"function": 5}]}),
    ("/v1/chat/completions", {"role": "assistant", "content": None, "tool_calls": "abc"}),
    (
        "/v1/messages",
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 7}]},
    ),
    (
        "/v1/messages",
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": {}}]},
    ),
    ("/v1/messages", {"role": "user", "content": [{"type": "tool_result", "content": [{"type": 5}]}]}),
    ("/v1/messages", {"role": "user", "content": [5]}),
]


@pytest.mark.parametrize(("path", "turn"), MALFORMED_TURNS)
def test_malformed_turns_are_400_not_500(srv: Running, path: str, turn: dict[str, Any]) -> None:
    """Shapes a schema cannot catch (values typed Any reach the handlers): each is the client's 400."""
    messages = [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "go on"}]
    if path == "/v1/messages":
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, turn]
    r = post(srv, path, {"model": MODEL_ID, "max_tokens": 3, "messages": messages})
    assert r.status_code == 400, r.text


def test_n_times_max_tokens_is_bounded(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(engine_factory(tiny_model_path, index_dir), max_choice_tokens=256) as small:
        chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
        err = error_of(post(small, "/v1/chat/completions", {**chat, "n": 128, "max_tokens": 64}), 400)
        assert err["param"] == "n" and "128 x 64" in err["message"] and "256" in err["message"]
        assert post(small, "/v1/chat/completions", {**chat, "n": 4, "max_tokens": 8}).status_code == 200
        done = post(small, "/v1/completions", {"prompt": "x", "n": 16})  # 16 x completions' default of 16
        assert done.status_code == 200 and len(done.json()["choices"]) == 16
        err = error_of(post(small, "/v1/chat/completions", {**chat, "n": 2}), 400)  # n x the context
        assert err["param"] == "n"
