"""KV events (engine/kv_events.py): a ZMQ subscriber sees the blocks a real tiny-model request stores
on prefill and the ones evicted later, in vLLM's wire format, keyed by the engine's own block keys."""

from __future__ import annotations

import time

import pytest

from localllm.config import EngineConfig
from localllm.engine import kv_events
from localllm.engine.block_identity import block_hash
from localllm.engine.engine import LLMEngine
from localllm.engine.kv_events import KVEventPublisher, KVEventsConfig, external_hash
from localllm.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
BLOCK = 16


def test_config_parse_and_errors():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    )
    assert config.enabled and config.endpoint == "tcp://*:6000" and config.topic == "kv"
    assert not KVEventsConfig.parse('{"publisher": "null"}').enabled
    for text, words in (("{", "not JSON"), ("[1]", "JSON object"), ('{"bogus": 1}', "unknown key(s) bogus")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            KVEventsConfig.parse(text)
    with pytest.raises(ValueError, match="publisher must be zmq or null"):
        KVEventsConfig.parse('{"publisher": "kafka"}')


def test_external_hash_is_the_last_eight_bytes_big_endian():
    key = bytes(range(16))
    assert external_hash(key) == int.from_bytes(bytes(range(8, 16)), "big") == 0x08090A0B0C0D0E0F
    assert external_hash(b"\xff" * 16) == 2**64 - 1  # unsigned, as vLLM sends it
    assert external_hash(key, as_int=False) == key


def test_missing_dependencies_is_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_zmq(name, *args, **kw):
        if name == "zmq":
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_zmq)
    message = kv_events.missing_dependencies()
    assert message is not None and "pyzmq" in message and "localllm[events]" in message
    assert "\n" not in message


zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'localllm[events]')")
msgpack = pytest.importorskip("msgpack", reason="msgpack is not installed (pip install 'localllm[events]')")


class Subscriber:
    """A SUB socket bound on loopback; the publisher connects to it (no slow-joiner race on the port)."""

    def __init__(self):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def receive(self, timeout_s: float = 5.0) -> tuple[bytes, int, list]:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise AssertionError("no KV event batch arrived")
        topic, seq, payload = self.socket.recv_multipart()
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)

    def wait_connected(self, publisher: KVEventPublisher) -> int:
        """Publish a clear until one arrives (the subscription takes a moment to reach the PUB side);
        returns the last sequence number seen, once nothing more is in flight."""
        deadline = time.monotonic() + 10
        while not self.socket.poll(50):
            assert time.monotonic() < deadline, "the publisher never connected"
            publisher.publish([{"type": "AllBlocksCleared"}])
        seq = self.receive()[1]
        while self.socket.poll(200):
            seq = self.receive()[1]
        return seq


@pytest.fixture
def wired(tiny_model_path, index_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_path), backend="numpy", index_dir=index_dir, threads=1,
            num_kv_blocks=8, block_size=BLOCK, ctx_size=128, max_num_seqs=2,
        )
    )  # fmt: skip
    sub = Subscriber()
    publisher = KVEventPublisher(KVEventsConfig(endpoint=sub.endpoint, topic="kv@test"))
    kv_events.attach(engine.block_manager, publisher)
    last_seq = sub.wait_connected(publisher)
    yield engine, sub, last_seq
    publisher.close()
    sub.socket.close(linger=0)


def expected_keys(engine: LLMEngine, tokens: list[int]) -> list[bytes]:
    keys, parent = [], None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = block_hash(parent, tokens[start : start + BLOCK], engine.block_manager.fingerprint)
        keys.append(parent)
    return keys


def events_until(sub: Subscriber, kind: str) -> tuple[list[dict], list[int]]:
    events, seqs = [], []
    while not any(e["type"] == kind for e in events):
        topic, seq, batch = sub.receive()
        assert topic == b"kv@test" and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
        events += batch[1]
        seqs.append(seq)
    return events, seqs


def test_prefill_stores_blocks_and_eviction_removes_them(wired):
    engine, sub, last_seq = wired
    prompt = list(range(10, 50))  # 40 tokens: two full blocks after prefill, the tail is partial
    engine.generate([prompt], ONE)
    events, seqs = events_until(sub, "BlockStored")
    assert seqs[0] == last_seq + 1
    keys = expected_keys(engine, prompt)
    stored = events[-1]
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "group_idx",
    ]  # vLLM's BlockStored fields, in declaration order  # fmt: skip
    assert stored["block_hashes"] == [external_hash(k) for k in keys] and len(keys) == 2
    assert stored["parent_block_hash"] is None and stored["token_ids"] == prompt[:32]
    assert (stored["block_size"], stored["medium"], stored["lora_id"]) == (BLOCK, "GPU", None)
    # a 120-token prompt takes all 8 blocks: the first prompt's cached ones are evicted, in the same
    # step (and batch) that stores the new prompt's 7 full blocks, chained from the root
    other = list(range(100, 220))
    engine.generate([other], ONE)
    events, seqs2 = events_until(sub, "BlockRemoved")
    assert seqs2[0] == seqs[-1] + 1 and all(b == a + 1 for a, b in zip(seqs2, seqs2[1:], strict=False))
    removal = next(e for e in events if e["type"] == "BlockRemoved")
    assert list(removal) == ["type", "block_hashes", "medium", "group_idx"]
    assert sorted(removal["block_hashes"]) == sorted(external_hash(k) for k in keys)
    stored = events[-1]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["block_hashes"] == [external_hash(k) for k in expected_keys(engine, other)]
    assert len(stored["block_hashes"]) == 7 and stored["token_ids"] == other[:112]


def test_a_full_queue_drops_instead_of_blocking():
    class Stalled(KVEventPublisher):
        def _run(self):  # no sending thread: the queue only fills
            return None

    publisher = Stalled(KVEventsConfig(endpoint="tcp://127.0.0.1:*", max_queue_size=2))
    start = time.perf_counter()
    for _ in range(5):
        publisher.publish([{"type": "AllBlocksCleared"}])
    assert publisher.dropped == 3 and time.perf_counter() - start < 0.5
    publisher._socket.close(linger=0)
