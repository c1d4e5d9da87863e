"""The chat page on a server of several models (`localllm serve A B`): a picker lists them with their
state, the chosen one answers (and loads for it), and the choice is kept across a reload. Chromium via
Playwright against the real CLI, skipped with the reason where no browser is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from tiny_model import write_tiny_model
from webui_harness import open_page, send, start_serve, stop_serve, wait_reply_done


def model_states(url: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in httpx.get(f"{url}/v1/models").json()["data"]}


def test_the_page_picks_the_model(chromium: Any, tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "tiny-a.Q8_0.gguf", seed=0)
    b = write_tiny_model(tmp_path / "tiny-b.Q8_0.gguf", seed=1)
    serve = start_serve(a, tmp_path, str(b), "--keep-alive", "-1")
    try:
        assert model_states(serve.url) == {"tiny-a.Q8_0": "unloaded", "tiny-b.Q8_0": "unloaded"}
        browser = open_page(chromium, serve.url)
        page = browser.page
        select = page.locator("#model-select")
        select.wait_for()
        assert select.locator("option").all_text_contents() == [
            "tiny-a.Q8_0 (unloaded)",
            "tiny-b.Q8_0 (unloaded)",
        ]
        assert page.locator("#model-info").text_content() == "loads with the first message"
        page.select_option("#model-select", "tiny-b.Q8_0")
        send(page, "hello there")
        wait_reply_done(page)
        assert model_states(serve.url) == {"tiny-a.Q8_0": "unloaded", "tiny-b.Q8_0": "loaded"}
        page.locator("#model-select option", has_text="tiny-b.Q8_0 (loaded)").wait_for(state="attached")
        assert "context 256 tokens" in (page.locator("#model-info").text_content() or "")
        page.reload()
        page.locator("#model-select option", has_text="(loaded)").wait_for(state="attached")
        assert select.input_value() == "tiny-b.Q8_0"  # the choice is kept
        assert browser.errors == []
    finally:
        stop_serve(serve)
