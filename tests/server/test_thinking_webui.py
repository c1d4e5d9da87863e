"""The chat page folds a thinking model's reasoning into a <details> element above the answer, and
keeps it apart when the conversation is sent back (chromium + Playwright, as test_webui.py; skipped
where they are not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import Running, engine_factory, running_server
from tiny_think import reply_ids, script_replies, write_think_model
from webui_harness import open_page, send, wait_reply_done

REPLY = "<think>\nThe user says hi. Answer kindly.\n</think>\n\nHello **there**!"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> Iterator[Running]:
    path = write_think_model(tmp_path_factory.mktemp("think") / "think.gguf")
    with running_server(engine_factory(path, index_dir, ctx_size=1024)) as running:
        ids = reply_ids(running.engine, REPLY)
        script_replies(running.engine, lambda seq: ids)
        yield running


def test_thinking_is_folded_above_the_answer(chromium: Any, srv: Running) -> None:  # noqa: F811
    b = open_page(chromium, srv.url + "/")
    page = b.page
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/completions") else None)
    send(page, "hi")
    reply = wait_reply_done(page)
    details = reply.locator("details.thinking")
    assert details.locator("summary").inner_text() == "Thought"
    assert details.get_attribute("open") is None  # folded once the answer is there
    assert reply.locator(".body > div").last.inner_text() == "Hello there!"  # the answer, as Markdown
    assert "The user says hi" not in reply.locator(".body > div").last.inner_text()
    details.locator("summary").click()
    assert details.locator("div").inner_text() == "The user says hi. Answer kindly."
    send(page, "again")
    page.locator(".msg.assistant").nth(1).locator(".stats").filter(has_text="token").wait_for()
    earlier = sent[-1]["messages"][1]
    assert earlier == {
        "role": "assistant",
        "content": "Hello **there**!",
        "reasoning_content": "The user says hi. Answer kindly.",
    }
    assert b.errors == []
