"""Property-based fuzzing of every endpoint from the server's own OpenAPI schema (schemathesis 4):
valid and invalid requests alike must never produce a 5xx, an undocumented status or content type, or
leave the engine unable to serve. Bounded: a fixed number of examples per operation and mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance
from server_harness import Running, engine_factory, running_server

from localllm.server.app import ServerConfig, create_app

# The schema comes from the app itself (no engine needed to build it), so operations are known at
# collection time; the requests go to a live server on the tiny model.
SCHEMA = schemathesis.openapi.from_dict(
    create_app(lambda: None, ServerConfig(model_id="tiny-llama")).openapi()
)
# POST /admin/drain stops the server by design (tests/server/test_worker.py tests it): not fuzzed here.
OPERATOR = {"POST /admin/drain"}
OPERATIONS = {
    op.label: op for op in (result.ok() for result in SCHEMA.get_all_operations()) if op.label not in OPERATOR
}
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]
# the others are cheap: 15
EXAMPLES = {
    "POST /v1/chat/completions": 30,
    "POST /v1/completions": 30,
    "POST /v1/responses": 30,
    "POST /v1/messages": 30,
}


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, max_num_seqs=4)) as running:
        yield running


# Negative cases need something to get wrong: a body (any string is a valid path parameter).
CASES = [
    (label, mode)
    for label, op in sorted(OPERATIONS.items())
    for mode in MODES
    if mode == schemathesis.GenerationMode.POSITIVE or len(op.body)
]


@pytest.mark.parametrize("label,mode", CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_fuzz_operation(srv: Running, label: str, mode: schemathesis.GenerationMode) -> None:
    operation = OPERATIONS[label]

    @settings(
        max_examples=EXAMPLES.get(label, 15),
        deadline=None,
        derandomize=True,  # the same examples every run: a failure here is reproducible
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=srv.url, checks=CHECKS, timeout=60)

    fuzz()
    srv.wait_idle()  # nothing leaked, and the engine still serves
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "still alive", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
