"""The uvicorn server `localllm serve` runs: guarded connections (connections.py), rate-limited logs
(logs.py), and a shutdown that ends every open stream with an error event before the wait for
connections begins, so SIGTERM/SIGINT finish in well under uvicorn's graceful timeout."""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
import uvicorn.config
from fastapi import FastAPI

from localllm.server.connections import ConnectionGuard, ConnectionLimits

GRACEFUL_TIMEOUT_S = 5  # then uvicorn cancels what is left; streams normally end in milliseconds


class GracefulServer(uvicorn.Server):
    """uvicorn's server that tells the app first when it starts shutting down."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()  # streams get their error event and [DONE] now, then uvicorn closes them
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
    return GracefulServer(config, app.state.server.begin_shutdown)
