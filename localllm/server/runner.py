"""The uvicorn server `localllm serve` runs: guarded connections (connections.py), rate-limited logs
(logs.py), a drain and a quick shutdown.

SIGTERM (or POST /admin/drain) drains, as a worker behind a router should: the listening sockets close,
/ready and new requests on open connections answer 503, the open requests run to their end (for at most
the drain timeout), then the server exits. SIGINT (Ctrl-C), a second SIGTERM, or a drain timeout of 0
shut down at once: every open stream ends with an error event before the wait for connections begins,
so they finish in well under uvicorn's graceful timeout."""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import socket
import time
from typing import Any

import uvicorn
import uvicorn.config
from fastapi import FastAPI

from localllm.server.connections import ConnectionGuard, ConnectionLimits
from localllm.server.model_pool import ModelPool

GRACEFUL_TIMEOUT_S = 5  # then uvicorn cancels what is left; streams normally end in milliseconds
log = logging.getLogger("localllm.server")


class GracefulServer(uvicorn.Server):
    """uvicorn's server that drains on SIGTERM and tells the app first when it starts shutting down."""

    def __init__(self, config: uvicorn.Config, state: ModelPool):
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None
        state.on_drain = self.start_drain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self.state.config.drain_timeout > 0 and not self.state.draining:
            if self.loop is not None:  # the handler runs between the loop's callbacks: hand it over
                self.loop.call_soon_threadsafe(self.start_drain)
                return
        super().handle_exit(sig, frame)

    def start_drain(self) -> None:
        """On the event loop: stop taking work, let the open requests finish, then exit."""
        if self.state.draining:
            return
        self.state.draining = True
        for server in getattr(self, "servers", []):
            server.close()  # new connections are refused: a router sends them to another replica
        self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        timeout = self.state.config.drain_timeout
        log.info("draining: %d open request(s), at most %.0f s", self.open_requests(), timeout)
        deadline = time.monotonic() + timeout
        while self.open_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True

    def open_requests(self) -> int:
        """HTTP requests being answered (this one's drain call excepted once it returned)."""
        return len(self.server_state.tasks) + self.state.in_flight()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_shutdown()  # what is left gets its error event and [DONE] now
        await super().shutdown(sockets)


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging with localllm's and asyncio's loggers printed the same way, all through one
    rate-limited handler, and no access log (the server logs one line per finished request)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["filters"] = {"rate_limit": {"()": "localllm.server.logs.RateLimitFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["rate_limit"]
    for name in ("localllm", "asyncio"):
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    limits: ConnectionLimits | None = None,
    log_level: str = "info",
    logging_config: dict[str, Any] | None = None,
) -> GracefulServer:
    """A uvicorn server for `app` (from create_app) with the connection guard in its h11 protocol."""
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=ConnectionGuard(limits).protocol,  # type: ignore[arg-type]  # uvicorn calls it per connection
        timeout_keep_alive=limits.keep_alive,  # type: ignore[arg-type]  # a float works: call_later
        log_level=log_level.lower(),
        log_config=logging_config,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
    )
    return GracefulServer(config, app.state.pool)
