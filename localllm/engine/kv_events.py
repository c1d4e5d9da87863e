"""KV-cache events in vLLM's wire format, so a router can route by the blocks a worker really holds.

The block manager notes each block it makes findable (BlockStored) and each one it forgets
(BlockRemoved) in a KVEventLog; the engine flushes the log once a step into a KVEventPublisher,
which hands the batch to a background thread through a bounded queue (a full queue drops the batch
and counts it: the engine step never waits on the network). The thread encodes and sends it on a ZMQ
PUB socket as vLLM's ZmqEventPublisher does: three frames, (topic, sequence number as 8 big-endian
bytes, msgpack payload).

The payload follows vllm/distributed/kv_events.py (v0.10 and later): an EventBatch is the array
[ts, events, data_parallel_rank]; each event a map tagged by its "type" ("BlockStored",
"BlockRemoved", "AllBlocksCleared") holding every field the struct declares without a default, in
declaration order (None as nil), and of the defaulted ones only those set (group_idx).

Block keys: localllm's are 16-byte BLAKE2b chain digests (block_identity.py). vLLM's default external
form of a hash is the integer of its last 8 bytes read big-endian (an unsigned 64-bit value), and
that is what is sent; `int_block_hashes: false` sends the whole 16-byte digest as bytes instead.

pyzmq and msgpack are the optional extra `localllm[events]`; nothing here imports them until a
publisher is made.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

log = logging.getLogger("localllm.kv_events")

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config: the keys of vLLM's KVEventsConfig that apply here, and two of ours."""

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"  # "*" or "::" in it (or ipc://, inproc://): bind; else connect
    topic: str = ""
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the sending thread; more are dropped
    medium: str = "GPU"  # vLLM's name for the engine's own KV pool (here in RAM); routers score it
    int_block_hashes: bool = True
    data_parallel_rank: int = 0

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON object; ValueError with one line naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: {sorted(known)}"
            )
        config = cls(**data)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, not {config.publisher!r}")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def external_hash(key: bytes, as_int: bool = True) -> int | bytes:
    """A block key in vLLM's external form: the unsigned integer of its last 8 bytes, big-endian."""
    return int.from_bytes(key[-8:], "big") if as_int else bytes(key)


class KVEventLog:
    """The events one engine step produced, as plain dicts in wire order; `flush` hands them on."""

    def __init__(self, block_size: int, sink: Any, medium: str = "GPU", int_hashes: bool = True):
        self.block_size, self.sink, self.medium, self.int_hashes = block_size, sink, medium, int_hashes
        self.pending: list[dict[str, Any]] = []

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        """Blocks `keys` (a chain, each the child of the one before) now findable after `parent`."""
        h = self.int_hashes
        self.pending.append(
            {
                "type": STORED,
                "block_hashes": [external_hash(k, h) for k in keys],
                "parent_block_hash": None if parent is None else external_hash(parent, h),
                "token_ids": list(token_ids),
                "block_size": self.block_size,
                "lora_id": None,
                "medium": self.medium,
                "lora_name": None,
                "group_idx": 0,
            }
        )

    def removed(self, key: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last["type"] == REMOVED:  # one event for a run of evictions
            last["block_hashes"].append(external_hash(key, self.int_hashes))
            return
        hashes = [external_hash(key, self.int_hashes)]
        self.pending.append({"type": REMOVED, "block_hashes": hashes, "medium": self.medium, "group_idx": 0})

    def cleared(self) -> None:
        self.pending.append({"type": CLEARED})

    def flush(self) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            self.sink.publish(events)


class KVEventPublisher:
    """A ZMQ PUB socket fed by a daemon thread from a bounded queue of event batches."""

    def __init__(self, config: KVEventsConfig):
        import msgpack
        import zmq

        self.config, self._packb = config, msgpack.packb
        self._socket: Any = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(config.max_queue_size)
        self._seq = count()
        self._topic = config.topic.encode()
        self.dropped = 0  # batches lost to a full queue
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The bound address (with the port the OS chose for tcp://*:0)."""
        import zmq

        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or self.config.endpoint

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one batch; never blocks (a full queue drops it, counted in `dropped`)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1

    def encode(self, events: list[dict[str, Any]], ts: float) -> bytes:
        return self._packb([ts, events, self.config.data_parallel_rank], use_bin_type=True)

    def _run(self) -> None:
        while (events := self._queue.get()) is not None:
            try:
                seq = next(self._seq).to_bytes(8, "big")
                self._socket.send_multipart((self._topic, seq, self.encode(events, time.time())))
            except Exception:  # a broken send must not end the thread: later batches still go out
                log.exception("KV event batch not sent")

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` s), then close the socket."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._socket.close(linger=int(timeout * 1000))


def attach(block_manager: Any, publisher: KVEventPublisher) -> KVEventLog:
    """Log `block_manager`'s events into `publisher`, starting with AllBlocksCleared: a subscriber that
    knew an earlier process at this endpoint forgets its blocks."""
    events = KVEventLog(
        block_manager.block_size, publisher, publisher.config.medium, publisher.config.int_block_hashes
    )
    events.cleared()
    events.flush()
    block_manager.events = events
    return events


def missing_dependencies() -> str | None:
    """A one-line error when pyzmq or msgpack is not installed, else None."""
    missing = []
    for module, package in (("zmq", "pyzmq"), ("msgpack", "msgpack")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if not missing:
        return None
    return f"--kv-events-config needs {' and '.join(missing)}: pip install 'localllm[events]'"
