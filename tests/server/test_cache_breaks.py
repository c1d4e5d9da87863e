"""Cache breaks explained, on the tiny model through HTTP: a conversation whose system prompt's timestamp
changes every turn gets each break reported at the token where the timestamp starts to differ (usage
field, /metrics counter, one rate-limited log line); an append-only conversation gets none."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import BAN_END, Running, engine_factory, post, running_server, sse_payloads

from localllm.server.cache_breaks import LOG_INTERVAL, CacheBreaks

TURNS = 21  # 20 turn pairs
INSTRUCTIONS = "Answer briefly. Cite the file you used. Ask before you delete anything."


def system(turn: int) -> str:
    return f"You are a coding agent. Time: 2025-06-01T12:{turn // 60:02d}:{turn % 60:02d}Z. {INSTRUCTIONS}"


def conversation(turns: int, stamp: Any) -> list[dict[str, str]]:
    """The messages of turn `turns`: a system prompt stamped `stamp(turns)`, then the exchanges so far."""
    messages = [{"role": "system", "content": system(stamp(turns))}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"q{i}"}]
        messages += [{"role": "assistant", "content": f"a{i}"}] if i < turns - 1 else []
    return messages


@pytest.fixture(scope="module")
def srv(tiny_model_path, index_dir) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, "numba", ctx_size=4096)) as running:
        yield running


def chat(srv: Running, messages: list, headers: dict | None = None, **extra: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "logit_bias": BAN_END, **extra}
    r = post(srv, "/v1/chat/completions", body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def rendered_ids(srv: Running, messages: list) -> list[int]:
    r = post(srv, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def breaks_counted(srv: Running) -> float:
    text = httpx.get(srv.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("localllm:prompt_cache_breaks_total"))
    return float(line.split()[-1])


@pytest.mark.parametrize(("keyed", "turns"), [("user", TURNS), ("x-session-id", 5), ("first message", 5)])
def test_every_timestamp_break_is_reported_at_its_token(srv, keyed, turns, caplog):
    extra = {"user": "agent-7"} if keyed == "user" else {}
    headers = {"x-session-id": "sess-42"} if keyed == "x-session-id" else {}
    counted = breaks_counted(srv)
    tokenizer = srv.engine.tokenizer
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="localllm.server"):
        for turn in range(1, turns + 1):
            messages = conversation(turn, lambda t: t)
            usage = chat(srv, messages, headers, **extra)
            found = usage["prompt_tokens_details"].get("cache_break")
            if turn == 1:
                assert found is None
                previous = rendered_ids(srv, messages)
                continue
            ids = rendered_ids(srv, messages)
            old_text, new_text = tokenizer.decode(previous), tokenizer.decode(ids)
            differs = next(i for i, (a, b) in enumerate(zip(old_text, new_text, strict=False)) if a != b)
            assert new_text[differs].isdigit()  # the character level: the timestamp's changing digit
            assert found is not None and found["previous_prompt_tokens"] == len(previous), (turn, found)
            # the token level, independently: the text before the reported token is shared and ends
            # within a few characters of that digit (a token may start a little before it)
            before = tokenizer.decode(ids[: found["token_index"]])
            assert old_text.startswith(before) and new_text.startswith(before)
            assert (
                0 <= differs - len(before) <= 8
                and ids[: found["token_index"]] == previous[: found["token_index"]]
            )
            assert ids[found["token_index"]] != previous[found["token_index"]]
            assert new_text[differs] in found["after"] and old_text[differs] in found["before"]
            previous = ids
    assert breaks_counted(srv) == counted + turns - 1
    logged = [r for r in caplog.records if "prompt cache break" in r.getMessage()]
    assert len(logged) <= 1 + (time.monotonic() - started) // LOG_INTERVAL  # not one per break


@pytest.mark.parametrize(("keyed", "turns"), [("first message", TURNS), ("prompt_cache_key", 5)])
def test_an_append_only_conversation_reports_nothing(srv, keyed, turns):
    extra = {"prompt_cache_key": "repo-x"} if keyed == "prompt_cache_key" else {}
    counted = breaks_counted(srv)
    for turn in range(1, turns + 1):
        usage = chat(srv, conversation(turn, lambda t: 0), **extra)
        assert "cache_break" not in usage["prompt_tokens_details"]
    assert breaks_counted(srv) == counted


def test_the_break_reaches_a_streamed_usage_chunk(srv):
    extra = {"user": "streamer", "stream": True, "stream_options": {"include_usage": True}}
    chat_stream = []
    for turn in (1, 2):
        body = {
            "messages": conversation(turn, lambda t: t + 100),
            "max_tokens": 1,
            "logit_bias": BAN_END,
            **extra,
        }
        r = post(srv, "/v1/chat/completions", body)
        chat_stream.append(sse_payloads(r.text)[-1]["usage"]["prompt_tokens_details"])
    assert "cache_break" not in chat_stream[0] and chat_stream[1]["cache_break"]["token_index"] > 0


def test_two_chats_opening_alike_are_not_one_conversation():
    """Keyed only by the first user message, a shorter conversation is another chat, not a break."""
    breaks = CacheBreaks()
    key = ("first:abc", False)
    long_prompt, other = list(range(200)), [0, 1, 2] + list(range(500, 600))
    assert breaks.observe(key, long_prompt, 9, str) is None
    assert breaks.observe(key, other, 3, str) is None  # fewer messages: a new chat
    assert breaks.observe(("user:u", True), long_prompt, 9, str) is None
    assert breaks.observe(("user:u", True), other, 3, str)["token_index"] == 3  # named: it is the same one


def test_small_edits_at_the_end_are_not_breaks():
    breaks = CacheBreaks()
    key = ("user:u", True)
    prompt = list(range(300))
    breaks.observe(key, prompt, 5, str)
    assert breaks.observe(key, prompt[:280] + [7] * 30, 5, str) is None  # the last message edited
    assert breaks.observe(key, prompt[:100] + [7] * 300, 7, str)["token_index"] == 100


def test_the_log_line_is_rate_limited(caplog):
    now = [100.0]
    breaks = CacheBreaks(clock=lambda: now[0])
    key = ("user:u", True)
    with caplog.at_level(logging.WARNING, logger="localllm.server"):
        for turn in range(21):
            assert (breaks.observe(key, [turn] + list(range(100)), 1, str) is None) == (turn == 0)
        now[0] += LOG_INTERVAL
        breaks.observe(key, [99] + list(range(100)), 1, str)
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 2 and "at token 0 of 101" in lines[0] and "(19 more since the last report)" in lines[1]
    )
    assert breaks.counter._value.get() == 21
