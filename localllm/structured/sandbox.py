"""Grammar validation in child processes, so no grammar can take the server down.

A pool of at most `sandbox_workers` children (sandbox_child.py), started on first use and reused. Each
request gets `timeout_s`; a child that runs past it is killed, one that dies (llguidance crashing on a
hostile grammar) is replaced, and either way the request gets a one-line error naming what happened.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from localllm.errors import InvalidRequestError
from localllm.structured.limits import GrammarLimits
from localllm.structured.spec import StructuredSpec

START_S = 60.0  # a child's start-up (Python and llguidance loading) on a loaded machine


class _ChildFailed(Exception):
    """The child gave no answer: it died or ran out of time (the message says which)."""


class _Child:
    def __init__(self, limits: GrammarLimits):
        self.fresh = True  # its ready message not read yet
        command = [sys.executable, "-m", "localllm.structured.sandbox_child"]
        command += [str(limits.sandbox_stack), str(limits.memory_bytes)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0
        )

    def wait_ready(self) -> None:
        """Wait for the child's first message (start-up is not part of a grammar's time budget)."""
        (size,) = struct.unpack(">I", self._read(4, time.monotonic() + START_S, START_S))
        self._read(size, time.monotonic() + START_S, START_S)

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, str]:
        data = json.dumps(request).encode()
        deadline = time.monotonic() + timeout_s
        try:
            self.process.stdin.write(struct.pack(">I", len(data)) + data)
        except (BrokenPipeError, OSError):
            raise _ChildFailed(self._death()) from None
        (size,) = struct.unpack(">I", self._read(4, deadline, timeout_s))
        return json.loads(self._read(size, deadline, timeout_s))

    def _read(self, n: int, deadline: float, timeout_s: float) -> bytes:
        fd = self.process.stdout.fileno()
        chunks: list[bytes] = []
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while n:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise _ChildFailed(f"compiling it took longer than {timeout_s:g} s, the limit")
                chunk = os.read(fd, n)
                if not chunk:
                    raise _ChildFailed(self._death())
                chunks.append(chunk)
                n -= len(chunk)
        return b"".join(chunks)

    def _death(self) -> str:
        code = self.process.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return f"the grammar library could not compile it (it failed with {how}); simplify the grammar"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


class GrammarSandbox:
    """Turns specs into validated llguidance grammars in child processes (thread-safe)."""

    def __init__(self, limits: GrammarLimits):
        self.limits = limits
        self._idle: list[_Child] = []
        self._slots = threading.BoundedSemaphore(limits.sandbox_workers)
        self._lock = threading.Lock()

    def grammar(self, spec: StructuredSpec) -> str:
        """The llguidance grammar for `spec`; InvalidRequestError (naming spec.name) if it is invalid,
        too slow to compile or crashes the library."""
        with self._slots:
            child = self._take()
            try:
                child.wait_ready() if child.fresh else None
                child.fresh = False
                reply = child.ask({"kind": spec.kind, "text": spec.text}, self.limits.timeout_s)
            except _ChildFailed as e:
                child.kill()
                raise InvalidRequestError(f"{spec.name}: {e}") from None
            with self._lock:
                self._idle.append(child)
        if "error" in reply:
            raise InvalidRequestError(f"{spec.name}: invalid {spec.kind}: {one_line(reply['error'])}")
        return reply["grammar"]

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.process.poll() is None:
                    return child
                child.kill()
        return _Child(self.limits)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def one_line(error: str, limit: int = 400) -> str:
    """llguidance's multi-line report (message, parser state, a caret under the grammar) as one line."""
    text = " ".join(error.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
