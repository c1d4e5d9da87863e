"""The chat page's browser fixtures, shared by the page's tests in this folder: one chromium and one
`localllm serve` on the tiny model per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from webui_harness import CHROMIUM, CHROMIUM_ARGS, Serve, start_serve, stop_serve


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium installed (apt-get install chromium; .ci/run does it)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (the test extra)"
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def serve(chromium: Any, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = start_serve(tiny_model_path, tmp_path_factory.mktemp("webui"))
    yield running
    stop_serve(running)
