"""`localllm serve --kv-events-config`: bad values and a missing extra are one line (exit 2) before any
model loads; a chat request through the server publishes its prompt's blocks on the ZMQ socket."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from server_harness import CHAT, engine_factory, post, running_server
from typer.testing import CliRunner

from localllm.cli import serve as serve_cli
from localllm.cli.app import app
from localllm.engine import kv_events


@pytest.mark.parametrize(
    ("value", "words"),
    [("{oops", "is not JSON"), ('{"endpoint": 5557, "nope": 1}', "unknown key(s) nope")],
)
def test_bad_config_is_one_line(tiny_model_path: Path, value: str, words: str) -> None:
    result = CliRunner().invoke(app, ["serve", str(tiny_model_path), "--kv-events-config", value])
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_extra_is_one_line(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "missing_dependencies", lambda: "--kv-events-config needs pyzmq: pip ...")
    config = '{"endpoint": "tcp://127.0.0.1:*"}'
    result = CliRunner().invoke(app, ["serve", str(tiny_model_path), "--kv-events-config", config])
    assert result.exit_code == 2 and result.stderr.strip() == "error: --kv-events-config needs pyzmq: pip ..."


def test_disabled_config_publishes_nothing() -> None:
    assert serve_cli.kv_event_publisher('{"enable_kv_cache_events": false}') is None
    assert serve_cli.kv_event_publisher(None) is None


def test_a_served_request_publishes_its_blocks(tiny_model_path: Path, index_dir: Path) -> None:
    zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'localllm[events]')")
    msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed")
    publisher = serve_cli.kv_event_publisher(json.dumps({"endpoint": "tcp://127.0.0.1:*", "topic": "w1"}))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"w1")
    sub.connect(publisher.endpoint)
    factory = serve_cli.with_kv_events(engine_factory(tiny_model_path, index_dir), publisher)
    try:
        with running_server(factory) as srv:
            time.sleep(0.3)  # the subscription reaches the PUB side (ZMQ's slow joiner)
            body = {"messages": CHAT * 6, "max_tokens": 2}  # a prompt of several full blocks
            assert post(srv, "/v1/chat/completions", body).status_code == 200
            block_size = srv.engine.block_manager.block_size
            stored = []
            while not stored:
                assert sub.poll(5000), "no BlockStored event arrived"
                topic, _, payload = sub.recv_multipart()
                ts, events, rank = msgpack.unpackb(payload, raw=False)
                stored = [e for e in events if e["type"] == "BlockStored"]
            assert topic == b"w1" and rank == 0 and ts > 0
            cached = srv.engine.block_manager.hash_to_block_id
            assert {kv_events.external_hash(k) for k in cached} >= set(stored[0]["block_hashes"])
            assert len(stored[0]["token_ids"]) == block_size * len(stored[0]["block_hashes"]) > 0
    finally:
        publisher.close()
        sub.close(linger=0)
