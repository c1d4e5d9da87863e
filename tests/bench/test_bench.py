"""`bench serve` and `bench batching`, briefly, on the tiny model and on a fake OpenAI server.

The fake server streams like an OpenAI completions endpoint and fails some requests on purpose (HTTP 500,
or a stream cut before [DONE]), chosen by a hash of the prompt so the test knows which ones.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from localllm.bench import server_process, serving
from localllm.bench.batching import KVSampler, held_tokens, parse_range
from localllm.errors import LocalLLMError

TOKENS_PER_WORD = 2  # the fake tokenizer: two tokens a word, plus one BOS


def fate(prompt: str) -> str:
    """What the fake server does with a streamed prompt: 'ok', 'http500' or 'drop'."""
    return {0: "http500", 1: "drop"}.get(zlib.crc32(prompt.encode()) % 5, "ok")


class FakeOpenAI(BaseHTTPRequestHandler):
    """HTTP/1.0, so each response ends by closing the connection; a 'drop' just closes it early."""

    server: Any

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def _json(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, obj: dict[str, Any] | str) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.models.add(body.get("model"))
        words = len(body["prompt"].split())
        usage = {"prompt_tokens": TOKENS_PER_WORD * words + 1, "completion_tokens": body["max_tokens"]}
        usage["prompt_tokens_details"] = {"cached_tokens": words}
        if not body.get("stream"):
            self._json(200, {"choices": [{"text": "x", "index": 0}], "usage": usage})
        elif fate(body["prompt"]) == "http500":
            self._json(500, {"error": {"message": "boom", "type": "server_error"}})
        else:
            self._stream(body, usage)

    def _stream(self, body: dict[str, Any], usage: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            if i == 2 and fate(body["prompt"]) == "drop":
                return  # the connection closes without [DONE]
            self._event({"choices": [{"index": 0, "text": " x", "finish_reason": None}], "usage": None})
            time.sleep(0.001)
        self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None})
        if self.server.send_usage and body.get("stream_options", {}).get("include_usage"):
            self._event({"choices": [], "usage": usage})
        self._event("[DONE]")


def _serve(send_usage: bool) -> Iterator[tuple[str, Any]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    httpd.daemon_threads = True
    httpd.send_usage, httpd.models = send_usage, set()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, Any]]:
    yield from _serve(send_usage=True)


@pytest.fixture(scope="module")
def fake_server_no_usage() -> Iterator[tuple[str, Any]]:
    yield from _serve(send_usage=False)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs `localllm ARGS` in-process with a private model home."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    from localllm.cli import bench  # noqa: F401  (registers the bench group and its modes)
    from localllm.cli.app import app

    def invoke(*args: str) -> Any:
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 0, (result.output, result.exception)
        return result

    return invoke


def check_ordered(stats: dict[str, float]) -> None:
    assert 0 <= stats["median"] <= stats["p90"] <= stats["p99"]


def check_level(level: dict[str, Any]) -> None:
    """A level's metrics agree with its own per-request records."""
    done = [r for r in level["requests"] if r["ok"]]
    assert level["completed"] == len(done)
    assert level["completed"] + level["failed"] == len(level["requests"])
    assert level["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert level["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert level["cached_tokens"] == sum(r["cached_tokens"] for r in done)
    if level["duration_s"]:
        total = level["total_input_tokens"] + level["total_output_tokens"]
        assert level["total_token_throughput"] == pytest.approx(total / level["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        check_ordered(level[key])
    assert all(r["ttft"] <= r["e2e"] for r in done)


# ------------------------------------------------------------------------------------------------ serve


def test_synthetic_workload_lengths_prefix_and_levels() -> None:
    specs = serving.synthetic_workload(20, 40, 10, 0.5, 2.0, prefix_len=16, seed=3)
    assert all(20 <= s.input_len - 16 <= 60 and 5 <= s.max_tokens <= 15 for s in specs)
    prefix = specs[0].prompt.split()[:8]  # 16 tokens at 2 tokens a word
    assert all(s.prompt.split()[:8] == prefix for s in specs)
    other = serving.synthetic_workload(20, 40, 10, 0.5, 2.0, prefix_len=16, seed=3, level=1)
    assert [s.max_tokens for s in other] == [s.max_tokens for s in specs]  # same shape, fresh words
    assert other[0].prompt != specs[0].prompt


def test_jsonl_workload(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt": "bye"}\n')
    specs = serving.jsonl_workload(path, 5, 7)
    assert [(s.prompt, s.max_tokens) for s in specs][:3] == [
        ("hello there", 5),
        ("bye", 7),
        ("hello there", 5),
    ]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(LocalLLMError, match="prompt"):
        serving.jsonl_workload(path, 1, 7)


def test_sweep_against_fake_server_counts_failures(fake_server: tuple[str, Any]) -> None:
    url, _ = fake_server
    specs = serving.synthetic_workload(24, 12, 6, 0.5, TOKENS_PER_WORD, seed=1)
    fates = [fate(s.prompt) for s in specs]
    assert {"ok", "http500", "drop"} <= set(fates), "the seed should exercise every failure"
    config = serving.LoadConfig(url, "fake-model", [1, 4], request_rate=math.inf)
    levels = serving.run_sweep(config, lambda level: specs, progress=False)
    for level in levels:
        check_level(level)
        assert level["failed"] == fates.count("http500") + fates.count("drop")
        ok = [s for s, f in zip(specs, fates, strict=True) if f == "ok"]
        assert level["total_output_tokens"] == sum(s.max_tokens for s in ok)
        assert level["cached_token_ratio"] == pytest.approx(
            sum(len(s.prompt.split()) for s in ok) / level["total_input_tokens"]
        )
        errors = " ".join(level["errors"])
        assert "HTTP 500" in errors and "[DONE]" in errors


def test_poisson_arrivals_spread_requests(fake_server: tuple[str, Any]) -> None:
    url, _ = fake_server
    specs = serving.synthetic_workload(6, 8, 3, 0.0, TOKENS_PER_WORD, seed=2)
    config = serving.LoadConfig(url, "fake-model", [8], request_rate=50.0, seed=0)
    (level,) = serving.run_sweep(config, lambda level: specs, progress=False)
    check_level(level)
    starts = sorted(r["start"] for r in level["requests"])
    assert starts[-1] > 0.01  # not all at once, although 8 slots were free


def test_chunks_counted_when_server_sends_no_usage(fake_server_no_usage: tuple[str, Any]) -> None:
    url, _ = fake_server_no_usage
    specs = [s for s in serving.synthetic_workload(12, 8, 5, 0.0, 2.0, seed=4) if fate(s.prompt) == "ok"]
    (level,) = serving.run_sweep(serving.LoadConfig(url, "m", [2]), lambda level: specs, progress=False)
    check_level(level)
    assert level["failed"] == 0
    assert [r["output_tokens"] for r in level["requests"]] == [s.max_tokens for s in specs]
    assert level["total_input_tokens"] == sum(s.input_len for s in specs)  # planned lengths stand in


def test_closed_port_gives_failed_requests_not_a_crash(cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "closed.json"
    url = f"http://127.0.0.1:{server_process.free_port()}"
    cli("bench", "serve", "--url", url, "--num-prompts", "3", "--concurrency", "2", "--json", str(out))
    (level,) = json.loads(out.read_text())["results"]
    assert level["completed"] == 0 and level["failed"] == 3
    assert level["output_throughput"] == 0 and "ConnectError" in level["errors"][0]


def test_cli_serve_url_json(cli: Any, fake_server: tuple[str, Any], tmp_path: Path) -> None:
    url, httpd = fake_server
    out = tmp_path / "serve.json"
    result = cli(
        "bench",
        "serve",
        "--url",
        url + "/v1",
        "--num-prompts",
        "8",
        "--input-len",
        "20",
        "--output-len",
        "4",
        "--concurrency",
        "1,3",
        "--dataset",
        "prefix",
        "--prefix-len",
        "10",
        "--json",
        str(out),
    )
    assert "Output token throughput" in result.output and "P99 TTFT" in result.output
    data = json.loads(out.read_text(), parse_constant=_no_infinity)  # strict JSON, for jq and friends
    system = data["system"]
    assert {"cpu", "physical_cores", "localllm_version", "git_revision", "date"} <= system.keys()
    assert system["model_name"] == "fake-model" and "fake-model" in httpd.models
    assert system["tokens_per_word"] == pytest.approx(TOKENS_PER_WORD)  # measured by the probe
    assert [lv["concurrency"] for lv in data["results"]] == [1, 3]
    for level in data["results"]:
        check_level(level)
        assert len(level["requests"]) == 8
        for r in level["requests"]:  # 10 prefix + ~20 input tokens, 2 tokens a word, + BOS
            assert not r["ok"] or 26 <= r["prompt_tokens"] <= 36
    assert data["config"]["prefix_len"] == 10 and data["config"]["request_rate"] == "inf"


def _no_infinity(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def test_plot_serving(cli: Any, fake_server: tuple[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "serve.png"
    cli(
        "bench",
        "serve",
        "--url",
        fake_server[0],
        "-n",
        "4",
        "--output-len",
        "3",
        "--concurrency",
        "1,2",
        "--plot",
        str(png),
    )
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.bench.plots import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(LocalLLMError, match=r"pip install 'localllm\[plot\]'"):
        require_matplotlib()


def _serve_registered() -> bool:
    result = subprocess.run(
        [sys.executable, "-m", "localllm", "serve", "--help"], capture_output=True, timeout=120
    )
    return result.returncode == 0


def test_bench_serve_starts_real_localllm_serve(cli: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    if not _serve_registered():
        pytest.skip("`localllm serve` is not registered yet")
    out = tmp_path / "real.json"
    cli(
        "bench",
        "serve",
        str(tiny_model_path),
        "--backend",
        "numpy",
        "--threads",
        "1",
        "--num-prompts",
        "4",
        "--input-len",
        "24",
        "--output-len",
        "4",
        "--concurrency",
        "1,2",
        "--dataset",
        "prefix",
        "--prefix-len",
        "48",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    assert data["system"]["model_sha256"] and data["system"]["backend"] == "numpy"
    for level in data["results"]:
        check_level(level)
        assert level["failed"] == 0 and level["total_output_tokens"] == 4 * 4  # ignore_eos: exact lengths
    assert data["results"][-1]["cached_tokens"] > 0  # the shared prefix hit the prefix cache


def _llama_server() -> str | None:
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")


@pytest.mark.skipif(_llama_server() is None, reason="no llama-server on PATH or in $LLAMA_SERVER")
def test_bench_serve_against_llama_server(cli: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    def command(port: int) -> list[str]:
        return [
            str(_llama_server()),
            "-m",
            str(tiny_model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "2",
            "-c",
            "1024",
            "-t",
            "1",
        ]

    out = tmp_path / "llama.json"
    with server_process.local_server(command, startup_timeout=120) as url:
        cli(
            "bench",
            "serve",
            "--url",
            url,
            "-n",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--concurrency",
            "1,2",
            "--json",
            str(out),
        )
    for level in json.loads(out.read_text())["results"]:
        check_level(level)
        assert level["failed"] == 0 and level["total_output_tokens"] > 0


# ------------------------------------------------------------------------------------------------ batching


def test_parse_range() -> None:
    assert parse_range("64:512") == (64, 512) and parse_range("8") == (8, 8)
    for bad in ("x", "9:3", "0:4"):
        with pytest.raises(LocalLLMError):
            parse_range(bad)


def test_kv_sampler_accounting() -> None:
    """Two sequences in blocks of 4: 6 and 3 tokens held in 2 + 1 blocks = 12 slots."""
    params = SimpleNamespace(max_tokens=5)
    seqs = [
        SimpleNamespace(block_table=[0, 1], num_computed_tokens=6, num_prompt_tokens=4, params=params),
        SimpleNamespace(block_table=[2], num_computed_tokens=3, num_prompt_tokens=2, params=params),
    ]
    assert held_tokens(seqs, 4) == 9
    engine = SimpleNamespace(
        block_manager=SimpleNamespace(num_blocks=10, num_free_blocks=7, block_size=4),
        scheduler=SimpleNamespace(running=seqs),
    )
    sampler = KVSampler(context=20)
    sampler.sample(engine)
    kv = sampler.summary(pool_tokens=40)
    assert kv["internal_waste"] == pytest.approx(3 / 12)
    assert kv["contiguous_used_over_reserved_max_tokens"] == pytest.approx(9 / (9 + 7))
    assert kv["contiguous_used_over_reserved_context"] == pytest.approx(9 / 40)


def test_cli_batching_tiny_model(cli: Any, tiny_model_path: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "batching.json", tmp_path / "batching.png"
    plot = ["--plot", str(png)] if _has_matplotlib() else []
    result = cli(
        "bench",
        "batching",
        str(tiny_model_path),
        "--backend",
        "numpy",
        "--threads",
        "1",
        "-n",
        "6",
        "--input-len",
        "8:40",
        "--output-len",
        "4:12",
        "--concurrency",
        "1,3",
        "--json",
        str(out),
        *plot,
    )
    assert "continuous" in result.output and "static" in result.output
    data = json.loads(out.read_text())
    assert data["system"]["model_sha256"] and data["system"]["backend"] == "numpy"
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 3]
    for level in data["levels"]:
        _check_batching_level(level, data)
    assert not plot or png.read_bytes()[:4] == b"\x89PNG"


def _check_batching_level(level: dict[str, Any], data: dict[str, Any]) -> None:
    runs = level["runs"]
    for mode, run in runs.items():
        assert run["output_tokens"] == data["config"]["output_tokens"], mode  # ignore_eos: exact work
        assert len(run["latencies"]) == data["config"]["num_requests"]
        lat = run["latency_s"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= run["wall_s"] + 1e-6
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        assert all(t <= e for t, e in zip(run["ttfts"], run["latencies"], strict=True))
    ratio = runs["continuous"]["output_tokens_per_s"] / runs["static"]["output_tokens_per_s"]
    assert level["continuous_over_static"] == pytest.approx(ratio)
    kv = level["kv"]
    assert 1 <= runs["contiguous"]["max_num_seqs"] == kv["contiguous_max_num_seqs"] <= level["concurrency"]
    assert kv["contiguous_max_num_seqs"] == min(
        level["concurrency"], data["pool_tokens"] // data["slot_tokens"]
    )
    assert 0 <= kv["internal_waste"] < 15 / (15 + 8)  # at most block_size - 1 empty slots per sequence
    peak = kv["peak_tokens"]
    assert peak["used"] <= peak["allocated"] <= data["pool_tokens"]
    assert kv["mean_tokens"]["reserved_max_tokens"] <= kv["mean_tokens"]["reserved_context"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_names_the_kernel_family_that_ran() -> None:
    """The system line under every offline result says which SIMD kernels the numba backend ran."""
    from localllm.bench.report import _system_line
    from localllm.bench.system import system_info
    from localllm.kernels.simd_x86 import HAVE_AVX2, HAVE_VNNI256
    from localllm.kernels.simd_x512 import HAVE_AVX512, HAVE_VNNI

    info = system_info(None, "numba", 1)
    expected = ("avx2-vnni" if HAVE_VNNI256 else "avx2") if HAVE_AVX2 else "portable"
    expected = "avx512-vnni" if HAVE_VNNI else "avx512" if HAVE_AVX512 else expected
    assert info["kernels"] == expected
    assert f"cores, {expected} kernels; localllm" in _system_line(info)
    assert "kernels" not in system_info(None, "numpy", 1)
