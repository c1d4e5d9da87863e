"""Connection-level protection for `localllm serve`, below the ASGI app where uvicorn stops.

uvicorn has a keep-alive timeout but no deadline for a request's headers or body, so a client that
sends one byte every few seconds (slowloris) holds a socket forever, and a few thousand of them use up
the process's file descriptors. `GuardedH11Protocol` is uvicorn's h11 protocol plus:

- a header deadline (`header_timeout`, counted from the connection or the previous response) and a
  body deadline (`body_timeout`, counted from the end of the headers), enforced by one sweep a second;
- a connection limit: at the limit, a new connection closes the oldest one that is waiting for a
  request (a slow or idle client) to make room, so a flood of slow sockets cannot lock legitimate
  clients out; only when every connection is busy with a request is the new one refused, with a 503
  in OpenAI's error shape;
- one summary log line per interval instead of a line per connection.

`raise_open_file_limit` lifts the soft RLIMIT_NOFILE toward the hard limit so the limit is reachable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from localllm.server.errors import error_body

log = logging.getLogger("localllm.server")

FD_RESERVE = 128  # descriptors kept for the model file, threads, logs and the listening socket
REFUSED_LINGER_S = 0.5  # a refused socket reads (and drops) the request this long, so no RST eats the 503
REPORT_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 4096
    header_timeout: float = 10.0  # seconds to send a complete request line and headers
    body_timeout: float = 60.0  # seconds to send the whole body once the headers are in
    keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's own timer)


class ConnectionGuard:
    """State shared by every connection of one server: who waits for what since when, and counters."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        # insertion-ordered, so the oldest waiter is first: O(1) eviction, the sweep stops early
        self.waiting: dict[GuardedH11Protocol, float] = {}  # for a request's headers
        self.uploading: dict[GuardedH11Protocol, float] = {}  # for a request's body
        self.counts = {"header_timeout": 0, "body_timeout": 0, "evicted": 0, "refused": 0}
        self._sweeping = False
        self._reported = time.monotonic()

    def protocol(self, *args: Any, **kwargs: Any) -> GuardedH11Protocol:
        """The factory uvicorn calls for each connection (its `http` setting)."""
        return GuardedH11Protocol(*args, guard=self, **kwargs)

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """At the limit, close the oldest connection waiting for a request; refuse only if none is."""
        self._start_sweep(conn.loop)
        if len(conn.connections) < self.limits.max_connections:
            return True
        if self.waiting:
            oldest = next(iter(self.waiting))
            self.forget(oldest)
            oldest.drop()
            self.counts["evicted"] += 1
            return True
        self.counts["refused"] += 1
        return False

    def note(self, conn: GuardedH11Protocol, phase: str) -> None:
        """`conn` entered `phase` (headers, body or busy) now."""
        self.forget(conn)
        if phase == "headers":
            self.waiting[conn] = time.monotonic()
        elif phase == "body":
            self.uploading[conn] = time.monotonic()

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.waiting.pop(conn, None)
        self.uploading.pop(conn, None)

    def _start_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(1.0, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        self.counts["header_timeout"] += _expire(self.waiting, now - self.limits.header_timeout)
        self.counts["body_timeout"] += _expire(self.uploading, now - self.limits.body_timeout)
        if now - self._reported >= REPORT_EVERY_S:
            self._report(now)
        loop.call_later(1.0, self._sweep, loop)

    def _report(self, now: float) -> None:
        self._reported = now
        if not any(self.counts.values()):
            return
        c, lim = self.counts, self.limits
        log.warning(
            "connections in the last %.0f s: closed %d without complete headers after %g s and %d without "
            "a complete body after %g s; %d idle ones closed and %d refused at the limit of %d",
            REPORT_EVERY_S, c["header_timeout"], lim.header_timeout, c["body_timeout"], lim.body_timeout,
            c["evicted"], c["refused"], lim.max_connections,
        )  # fmt: skip
        self.counts = dict.fromkeys(self.counts, 0)


def _expire(waiters: dict[GuardedH11Protocol, float], cutoff: float) -> int:
    """Close the waiters that started before `cutoff` (they are in start order)."""
    expired = []
    for conn, since in waiters.items():
        if since >= cutoff:
            break
        expired.append(conn)
    for conn in expired:
        waiters.pop(conn, None)
        conn.drop()
    return len(expired)


def _refusal_bytes(limit: int) -> bytes:
    message = f"the server has too many open connections ({limit}); retry shortly"
    body = json.dumps(error_body(message, "server_error", None, "too_many_connections")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that reports its phase to the guard, and can be refused or dropped."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.refused = False
        self._phase = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.guard.admit(self):
            super().connection_made(transport)
            self._track()
            return
        # Answer at once and half-close; keep reading briefly so unread request bytes cause no RST.
        self.refused, self.transport = True, transport
        transport.write(_refusal_bytes(self.guard.limits.max_connections))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        super().connection_lost(exc)

    def drop(self) -> None:
        """Close without a response (a timed-out or evicted client)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _track(self) -> None:
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else "busy"
        if phase != self._phase:
            self._phase = phase
            self.guard.note(self, phase)


def raise_open_file_limit() -> int | None:
    """Lift the soft RLIMIT_NOFILE to the hard limit (macOS: OPEN_MAX); the soft limit after, or None
    where there is no such limit (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = [hard] if hard != resource.RLIM_INFINITY else []
    for target in [*targets, 10240]:  # 10240: macOS refuses more than OPEN_MAX even under "unlimited"
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def usable_connections(wanted: int, fd_limit: int | None) -> int:
    """`wanted`, lowered to what the descriptor limit allows (with a reserve for everything else)."""
    if fd_limit is None or fd_limit == -1:
        return wanted
    usable = max(16, fd_limit - FD_RESERVE)
    if usable < wanted:
        log.warning(
            "the open-file limit (%d) allows %d connections, not %d; raise `ulimit -n` for more",
            fd_limit, usable, wanted,
        )  # fmt: skip
    return min(wanted, usable)
