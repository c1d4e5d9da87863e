"""The OpenAI-compatible server on the tiny model: the official `openai` client, raw HTTP for the SSE
framing and every error case, disconnects, auth, CORS, loading, metrics and the CLI."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import (  # noqa: F401  (shared with the other server tests)
    BAN_END,
    CHAT,
    MODEL_ID,
    Running,
    SlowEngine,
    engine_factory,
    error_of,
    post,
    running_server,
    scrape,
    slow_factory,
    sse_payloads,
)

from localllm.engine.engine import LLMEngine
from localllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    aliases = (tiny_model_path.name, tiny_model_path.stem)
    with running_server(engine_factory(tiny_model_path, index_dir), model_aliases=aliases) as running:
        yield running


@pytest.fixture
def client(srv: Running) -> openai.OpenAI:
    return srv.client()


# --------------------------------------------------------------------------------------- openai client


def test_chat_completion(client: openai.OpenAI, srv: Running) -> None:
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_ID
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    srv.wait_idle()


def test_cached_tokens_reported(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a prompt long enough to fill at least two cache blocks " * 2}]
    first = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.choices[0].message.content == first.choices[0].message.content


def test_chat_stream(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_ID, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logit_bias": BAN_END}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_completions(client: openai.OpenAI, srv: Running) -> None:
    ids = srv.engine.tokenize_prompt("The quick brown fox")
    by_text = client.completions.create(
        model=MODEL_ID, prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion" and by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == by_ids.choices[0].text
    assert chunks[-1].choices[0].finish_reason == by_ids.choices[0].finish_reason
    echo = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hi")


def test_greedy_matches_engine(client: openai.OpenAI, tiny_model_path: Path, index_dir: Path) -> None:
    reference = engine_factory(tiny_model_path, index_dir)()  # the server's engine belongs to its thread
    ids = reference.tokenize_prompt("Once upon a time")
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=20))[0]
    got = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=20, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_ID,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        logit_bias=BAN_END,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy takes the best
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    plain = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    # greedy, so the run is deterministic: the legacy format keys alternatives by text, and two byte
    # tokens of the random tiny model can decode to the same replacement character
    r = client.completions.create(
        model=MODEL_ID, prompt="abc", max_tokens=4, logprobs=2, logit_bias=BAN_END, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) >= 2 for top in lp.top_logprobs)


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=MODEL_ID, prompt="seed test", max_tokens=24, temperature=1.0, seed=seed, logit_bias=BAN_END
        )
        return r.choices[0].text

    assert sample(42) == sample(42)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stop_string_never_leaks(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_ID, "prompt": "stop test", "max_tokens": 40, "temperature": 1.0, "seed": 7}
    full = client.completions.create(**kw, logit_bias=BAN_END).choices[0].text
    at = next(
        i for i in range(3, len(full) - 2) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    stop = full[at : at + 2]
    for stream in (False, True):
        r = client.completions.create(**kw, logit_bias=BAN_END, stop=[stop, "never-there"], stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[: full.index(stop)] and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_ID, prompt="x", max_tokens=6, temperature=0.7, logit_bias={"101": 100}
    )
    assert r.choices[0].text == "b" * 6  # token 101 is the byte 'b' (3 specials, then the 256 bytes)


def test_default_lengths(client: openai.OpenAI, srv: Running) -> None:
    # no max_tokens and no temperature: OpenAI's temperature 1; chat runs to the context limit, legacy
    # completions stop at OpenAI's 16 tokens
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, logit_bias=BAN_END)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == srv.engine.max_model_len
    r = client.completions.create(model=MODEL_ID, prompt="fill", logit_bias=BAN_END)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16


def test_extensions_and_penalties_accepted(srv: Running) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 4,
        "top_k": 5,
        "min_p": 0.1,
        "repeat_penalty": 1.3,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "seed": -5,
        "stop": "zz",
        "user": "u",
        "store": False,
    }
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r = post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "repetition_penalty": 1.1})
    assert r.status_code == 200, r.text


def test_lenient_inputs(srv: Running) -> None:
    # curl -d sends a form Content-Type; text content parts and the `developer` role are accepted
    body = json.dumps({"prompt": "curl", "max_tokens": 2})
    r = httpx.post(
        f"{srv.url}/v1/completions",
        content=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200, r.text
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = post(srv, "/tokenize", {"messages": messages}).json()["tokens"]
    assert "<|im_start|>system\nbe brief" in srv.engine.tokenizer.decode(ids)


def test_models_and_tokenizer_routes(client: openai.OpenAI, srv: Running, tiny_model_path: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    r = client.chat.completions.create(model=tiny_model_path.name, messages=CHAT, max_tokens=1)
    assert r.model == MODEL_ID  # the file name is accepted as an alias
    ids = post(srv, "/tokenize", {"prompt": "hello world"}).json()
    assert ids["tokens"] == srv.engine.tokenize_prompt("hello world") and ids["count"] == len(ids["tokens"])
    assert post(srv, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
    chat_ids = post(srv, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert srv.engine.tokenizer.decode(chat_ids).endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------- raw SSE


def test_sse_framing_chat(srv: Running) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "stream": True, "logit_bias": BAN_END, "temperature": 0}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.read().decode())
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    ids = {p["id"] for p in payloads}
    assert len(ids) == 1 and all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert all("usage" not in p for p in payloads)  # only present when include_usage is asked for
    assert all(p["choices"][0]["delta"].get("content") for p in payloads[1:-1])


def test_sse_framing_completion_with_usage(srv: Running) -> None:
    body = {"prompt": "abc", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    body["logit_bias"] = BAN_END
    payloads = sse_payloads(post(srv, "/v1/completions", body).text)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads[:-1])


def test_utf8_deltas_are_whole_characters(srv: Running) -> None:
    body = {
        "prompt": "é",
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": 3,
        "stream": True,
        "logit_bias": BAN_END,
    }
    raw = post(srv, "/v1/completions", body).content
    raw.decode("utf-8")  # strict: a split character would raise here
    text = "".join(p["choices"][0]["text"] for p in sse_payloads(raw.decode()))
    assert text == post(srv, "/v1/completions", {**body, "stream": False}).json()["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------- errors


BAD_BODIES = [
    ("{not json", None),
    ('{"messages": "hello"}', "messages"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}', "top_p"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    (
        '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": true}',
        "top_logprobs",
    ),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1000}}', "logit_bias.5"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}', "logit_bias"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}', "logit_bias"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
    ('{"messages": []}', "messages"),
    ("[]", None),
    ("", None),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_chat_requests_are_400(srv: Running, body: str, param: str | None) -> None:
    err = error_of(post(srv, "/v1/chat/completions", body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_bad_completion_requests_are_400(srv: Running) -> None:
    for body in (
        {"prompt": [1, 2, 100000]},
        {"prompt": [-1]},
        {"prompt": ""},
        {"prompt": ["a", ""]},
        {"prompt": 5},
        {"prompt": "x", "logprobs": 99},
        {"prompt": "x", "best_of": 3},
    ):
        error_of(post(srv, "/v1/completions", body), 400)


def test_unknown_model_is_404(srv: Running) -> None:
    err = error_of(post(srv, "/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]
    error_of(post(srv, "/v1/completions", {"model": "gpt-4o", "prompt": "x"}), 404)
    error_of(httpx.get(f"{srv.url}/v1/models/gpt-4o"), 404)
    with pytest.raises(openai.NotFoundError):
        srv.client().chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)


def test_context_length_exceeded(srv: Running) -> None:
    err = error_of(post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 250}), 400)
    assert err["code"] == "context_length_exceeded"
    assert "256" in err["message"] and "250" in err["message"]
    long_prompt = {"prompt": list(range(3, 263))}  # 260 tokens: no room at all, with or without max_tokens
    assert error_of(post(srv, "/v1/completions", long_prompt), 400)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model=MODEL_ID, prompt=[5] * 200, max_tokens=100)
    assert e.value.code == "context_length_exceeded"


def test_unknown_routes_and_methods(srv: Running) -> None:
    error_of(httpx.get(f"{srv.url}/v1/nothing"), 404)
    error_of(httpx.get(f"{srv.url}/v1/chat/completions"), 405)


# ------------------------------------------------------------------------------------------- resources


def abort_count(srv: Running) -> float:
    return scrape(srv.url).get('localllm:request_success_total{finished_reason="abort"}', 0.0)


@pytest.fixture(scope="module")
def slow(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(slow_factory(tiny_model_path, index_dir)) as running:
        yield running


def test_stream_disconnect_aborts_and_frees_blocks(slow: Running) -> None:
    body = {"prompt": "disconnect me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    before = abort_count(slow)
    with httpx.stream("POST", f"{slow.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert slow.state.engine.num_running == 1
    slow.wait_idle(timeout=2)  # 200 tokens would take > 2 s: the request was aborted, not finished
    assert abort_count(slow) == before + 1


def test_non_stream_disconnect_aborts(slow: Running) -> None:
    before = abort_count(slow)
    with pytest.raises(httpx.ReadTimeout):
        post(
            slow,
            "/v1/completions",
            {"prompt": "wait for me", "max_tokens": 200, "ignore_eos": True},
            timeout=0.3,
        )
    slow.wait_idle(timeout=2)
    assert abort_count(slow) == before + 1


def test_queue_full_is_503_with_retry_after(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(slow_factory(tiny_model_path, index_dir, max_num_seqs=1), max_queue=1) as srv:
        body = {"prompt": "busy", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: closing this iterator would close the connection
            next(lines)  # running now
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body) as second:
                assert second.status_code == 200  # accepted: it waits for the only slot
                third = post(srv, "/v1/completions", {**body, "stream": False})
                assert error_of(third, 503)["code"] == "queue_full" and third.headers["retry-after"]
        srv.wait_idle()


# ------------------------------------------------------------------------------------------ auth, CORS


def test_api_key_and_cors(tiny_model_path: Path, index_dir: Path) -> None:
    factory = engine_factory(tiny_model_path, index_dir)
    with running_server(factory, api_key="s3cret", cors_origins=("http://app.example",)) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # stays open
        assert error_of(httpx.get(f"{srv.url}/v1/models"), 401)["code"] == "invalid_api_key"
        wrong = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        assert error_of(post(srv, "/v1/completions", "{bad json"), 401)  # auth first, then parsing
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="nope").models.list()
        r = srv.client(api_key="s3cret").completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
        pre = httpx.options(f"{srv.url}/v1/chat/completions", headers=preflight)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"


def test_cors_off_by_default(srv: Running) -> None:
    r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------------------------------- lifecycle


def test_health_503_while_loading(tiny_model_path: Path, index_dir: Path) -> None:
    release = threading.Event()
    inner = engine_factory(tiny_model_path, index_dir)

    def gated() -> LLMEngine:
        release.wait(30)
        return inner()

    with running_server(gated, wait=False) as srv:
        assert error_of(httpx.get(f"{srv.url}/health"), 503)["code"] == "model_loading"
        assert error_of(post(srv, "/v1/chat/completions", {"messages": CHAT}), 503)
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == MODEL_ID
        release.set()
        srv.wait_ready(timeout=10)
        engine = srv.state.engine
    assert not engine._thread.is_alive()  # the app's shutdown stopped the engine thread


def test_load_failure_reported(tmp_path: Path) -> None:
    failures: list[BaseException] = []
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    factory = engine_factory(bad, tmp_path)
    with running_server(factory, wait=False, on_load_error=failures.append) as srv:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "failed to load" in error_of(httpx.get(f"{srv.url}/health"), 503)["message"]


def test_metrics(srv: Running, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_ID, prompt="count me", max_tokens=3, logit_bias=BAN_END)
    values = scrape(srv.url)
    for name in (
        "localllm:num_requests_running",
        "localllm:num_requests_waiting",
        "localllm:kv_cache_usage_perc",
        "localllm:prefix_cache_queries_total",
        "localllm:prefix_cache_hits_total",
        "localllm:prompt_tokens_total",
        "localllm:generation_tokens_total",
        'localllm:request_success_total{finished_reason="length"}',
        'localllm:time_to_first_token_seconds_bucket{le="+Inf"}',
        'localllm:inter_token_latency_seconds_bucket{le="+Inf"}',
        'localllm:e2e_request_latency_seconds_bucket{le="+Inf"}',
        "localllm:time_per_output_token_seconds_count",
    ):
        assert name in values, name
        assert name.replace("localllm:", "vllm:") in values, name  # vLLM's names, for its routers
    assert values["localllm:generation_tokens_total"] >= 3
    assert values["localllm:kv_cache_usage_perc"] == 0.0
    assert values["vllm:time_per_output_token_seconds_count"] >= 1
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.url}/metrics").text
    labels = {s.labels.get("model_name") for f in text_string_to_metric_families(text) for s in f.samples}
    assert labels == {MODEL_ID}


def test_request_log_line(srv: Running, client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="localllm.server"):
        r = client.completions.create(model=MODEL_ID, prompt="log me", max_tokens=3, logit_bias=BAN_END)
        deadline = time.monotonic() + 2
        while not any(r.id in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.01)
    line = next(m for m in caplog.messages if r.id in m)
    assert "generated 3 tokens" in line and "TTFT" in line and "tok/s" in line


# ------------------------------------------------------------------------------------------------- CLI


def test_serve_help() -> None:
    from typer.testing import CliRunner

    import localllm.cli.serve  # noqa: F401  (registers the command)
    from localllm.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in ("--port", "--host", "--parallel", "--ctx-size", "--kv-cache-mb", "--api-key", "--max-queue"):
        assert flag in result.output
    assert "Examples" in result.output


# ------------------------------------------------------------------------------------------ real model


def _real_backend() -> str:
    try:
        import localllm.backends.numba_cpu  # noqa: F401

        return "numba"
    except Exception:
        return "numpy"


@pytest.mark.slow
def test_real_model_greedy_matches_engine(smollm2_path: Path, index_dir: Path) -> None:
    from localllm.tokenizer.chat_template import ChatTemplate, apply_chat_template

    factory = engine_factory(smollm2_path, index_dir, backend=_real_backend(), max_num_seqs=2, ctx_size=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with running_server(factory, model_id="smollm2-135m-instruct") as srv:
        r = srv.client().chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0
        )
    reference = factory()  # after the server (and its engine thread) stopped
    ids = apply_chat_template(
        reference.tokenizer, ChatTemplate.from_metadata(reference.gguf.metadata), messages
    )
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0]
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(ids)


def test_an_event_is_one_line_whatever_the_text_holds() -> None:
    """U+0085, U+2028 and U+2029 break lines for str.splitlines (httpx's iter_lines, many clients);
    json.dumps leaves them raw without ensure_ascii, so a token holding one cut its event in two."""
    from localllm.server.streaming import sse, sse_event

    payload = {"choices": [{"delta": {"content": "a\x85b\u2028c\u2029d, é 日本"}}]}
    for raw in (sse(payload), sse_event("message", payload)):
        text = raw.decode()
        [data] = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert json.loads(data) == payload and "é 日本" in text  # other text stays as it is
