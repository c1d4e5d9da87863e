"""The chat page's browser harness: a `localllm serve` process on the tiny model, chromium pages through
playwright, and the helpers that drive the page (send, wait for a reply, measure the paint)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from paths import ROOT
from server_harness import scrape

ARTIFACTS = Path(os.environ.get("LOCALLLM_TEST_ARTIFACTS", ROOT / "build/test-artifacts/webui"))


CHROMIUM = os.environ.get("LOCALLLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


MAX_TRANSFER = 200_000  # bytes of the page and its assets


SLOW_SERVE = """
import sys, time
from localllm.engine.engine import LLMEngine
step, delay = LLMEngine.step, float(sys.argv[1])
def slow_step(self):
    time.sleep(delay)
    return step(self)
LLMEngine.step = slow_step
sys.argv = ["localllm", *sys.argv[2:]]
from localllm.cli import main
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Serve:
    url: str
    proc: subprocess.Popen
    log: Path


@dataclass
class Browser:
    """A chromium page with its console errors collected."""

    page: Any
    errors: list[str] = field(default_factory=list)

    def expected_errors(self, *statuses: int) -> list[str]:
        """The errors left once the network-status lines for `statuses` (refusals a test provokes) go."""
        quiet = [f"status of {s} " for s in statuses]
        return [e for e in self.errors if not any(q in e for q in quiet)]


def start_serve(model: Path, tmp: Path, *flags: str, step_s: float = 0.02) -> Serve:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    args = ["serve", str(model), "--backend", "numpy", "--threads", "1", "--port", str(port), *flags]
    env = {**os.environ, "LOCALLLM_HOME": str(tmp / "home")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_SERVE, str(step_s), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    serve = Serve(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{serve.url}/health").status_code == 200:
                return serve
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_serve(serve)
    raise AssertionError(f"the server did not become ready:\n{log.read_text()}")


def stop_serve(serve: Serve) -> None:
    serve.proc.terminate()
    try:
        serve.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        serve.proc.kill()


def open_page(chromium: Any, url: str, width: int = 1280, height: int = 800) -> Browser:
    context = chromium.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(20_000)
    browser = Browser(page)
    page.on("console", lambda m: browser.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: browser.errors.append(f"uncaught: {e}"))
    page.goto(url)
    return browser


def set_settings(page: Any, **values: str) -> None:
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    for name, value in values.items():
        page.fill(f"#{name}", value)
        page.dispatch_event(f"#{name}", "change")
    if page.viewport_size["width"] <= 760:
        page.click("#toggle-settings")


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_reply_done(page: Any) -> Any:
    """The last reply, once its stats line is written (the stream ended)."""
    reply = page.locator(".msg.assistant").last
    reply.locator(".stats").filter(has_text="token").wait_for()
    return reply


def save_metrics(name: str, data: dict[str, Any]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(data, indent=2))


def page_metrics(page: Any) -> dict[str, Any]:
    """First contentful paint and the bytes the page and its assets took, from the Performance API."""
    return page.evaluate(
        """() => {
        const paint = performance.getEntriesByName("first-contentful-paint")[0];
        const byType = (t) => performance.getEntriesByType(t);
        const entries = [...byType("navigation"), ...byType("resource")];
        return {
          first_contentful_paint_ms: paint ? paint.startTime : null,
          dom_content_loaded_ms: performance.getEntriesByType("navigation")[0].domContentLoadedEventEnd,
          transferred_bytes: entries.reduce((n, e) => n + e.transferSize, 0),
          decoded_bytes: entries.reduce((n, e) => n + e.decodedBodySize, 0),
          requests: entries.map((e) => e.name),
        };
      }"""
    )


def assert_server_idle(serve: Serve) -> None:
    """The stopped request was aborted, so no sequence runs and its blocks are back."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        metrics = scrape(serve.url)
        if metrics["localllm:num_requests_running"] == 0 and metrics["localllm:kv_cache_usage_perc"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the stopped request is still running")


MARKDOWN_REPLY = """## Reversing a list

Use **slicing** or `reversed()`, see [the docs](https://docs.python.org/3/library/functions.html):

1. `xs[::-1]` makes a *new* list
2. `xs.reverse()` works in place

```python
def reverse(xs: list[int]) -> list[int]:
    # a copy, reversed
    return xs[::-1]  # O(n)
```

> Escaped, never run: <img src=x onerror="window.pwned=1"> <script>window.pwned=1</script>
[bad link](javascript:window.pwned=1)
"""


SAVED_CHAT = {
    "id": "c1",
    "title": "Reverse a list in Python",
    "created": 1,
    "updated": 1,
    "messages": [
        {"role": "user", "content": "How do I reverse a list in Python?"},
        {
            "role": "assistant",
            "content": MARKDOWN_REPLY,
            "stats": "96 tokens · 41.3 tok/s · first token 85 ms · prompt 38 tokens, 0 cached",
        },
    ],
}
