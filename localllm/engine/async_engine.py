"""The engine on its own thread: front ends submit requests and read per-request output streams.

One thread owns the model and calls `LLMEngine.step()`; HTTP handlers and the chat loop never touch it.
Commands reach it through a queue; each request's outputs go to the sink it was submitted with.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from localllm.engine.engine import EngineStats, LLMEngine
from localllm.engine.output import StepOutput
from localllm.errors import LocalLLMError
from localllm.sampling_params import SamplingParams

log = logging.getLogger("localllm.engine")
Sink = Callable[[StepOutput | BaseException], None]


class QueueFull(LocalLLMError):
    code = "queue_full"


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 0):
        self.engine = engine
        self.max_queue = max_queue  # waiting requests allowed; 0 = unbounded
        self._commands: queue.Queue[tuple] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="localllm-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def stats(self) -> EngineStats:
        """The engine's counts, with requests still on their way to it counted as waiting."""
        return dataclasses.replace(self.engine.stats(), num_waiting=self.num_waiting)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str,
        group: str | None = None,
    ) -> None:
        """Validate and queue a request (raises LocalLLMError for bad input or a full queue); `group`:
        see LLMEngine.add_request."""
        self.engine.check_prompt(len(prompt_ids))
        if self.max_queue and self.num_waiting >= self.max_queue:
            raise QueueFull(f"the server is busy: {self.num_waiting} requests are already waiting")
        self._commands.put(("add", request_id, prompt_ids, params, sink, group))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread before its next step (see LLMEngine.call_soon); wakes it if idle."""
        self._commands.put(("call", fn))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands(block=not self.engine.has_unfinished())
            if self._stopping:
                break
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not leave clients hanging: fail what is in flight
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, sink, group = command
            try:
                self.engine.add_request(prompt_ids, params, request_id, group)
                self._sinks[request_id] = sink
            except LocalLLMError as e:
                sink(e)
        elif kind == "abort":
            out = self.engine.abort(command[1])
            sink = self._sinks.pop(command[1], None)
            if out is not None and sink is not None:
                sink(out)
        elif kind == "call":
            self.engine.call_soon(command[1])
        elif kind == "stop":
            self._stopping = True

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            self._sinks.pop(out.request_id, None)
        if sink is not None:
            sink(out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink(error)
        self._sinks.clear()

    def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Iterator[StepOutput]:
        """Blocking iterator over one request's outputs; closing it early aborts the request."""
        q: queue.Queue[StepOutput | BaseException] = queue.Queue()
        self.submit(prompt_ids, params, q.put, request_id)
        yield from _drain(lambda: q.get(), lambda: self.abort(request_id))


def _drain(get: Callable[[], Any], abort: Callable[[], None]) -> Iterator[StepOutput]:
    finished = False
    try:
        while True:
            item = get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            abort()
