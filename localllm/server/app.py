"""The OpenAI-compatible HTTP server, assembled: the route table, the lifespan, and `create_app`.

`create_app(engine_factory, config)` returns the FastAPI app. The engine loads on a background thread
when the app starts, so /health answers 503 while the model loads and 200 once it serves. With
`models` (several), each loads on its first request instead (model_pool.py). The floors
below this module: each endpoint family in its own module (chat, completions, embeddings, responses,
messages, models, tokens, health), the shared pipeline (pipeline.py), the state (state.py), and the
error shapes and handlers (errors.py) and ASGI guards (guards.py) around them all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from localllm.engine.engine import LLMEngine
from localllm.server.cache_breaks import SessionHeaderMiddleware
from localllm.server.chat import chat_completions
from localllm.server.completions import completions
from localllm.server.embeddings import create_embeddings
from localllm.server.errors import ANTHROPIC_PATH, ErrorResponse, add_error_handlers
from localllm.server.guards import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    BrowserGuard,
    JsonBodyMiddleware,
)
from localllm.server.health import drain, health, metrics, readiness
from localllm.server.messages import count_message_tokens, create_message
from localllm.server.model_pool import LeaseMiddleware, ModelPool, PoolLimits, ServedModel
from localllm.server.models import get_model, list_models
from localllm.server.responses import create_response
from localllm.server.state import ServerConfig, ServerState
from localllm.server.tokens import detokenize, tokenize
from localllm.server.webui import WEBUI_PATHS, add_webui_routes

__all__ = ["PoolLimits", "ServedModel", "ServerConfig", "ServerState", "create_app"]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    503: {"model": ErrorResponse, "description": "Loading, or the queue is full"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "No such model"}}
STREAMABLE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A completion, or Server-Sent Events when stream is true",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


def _routes(app: FastAPI) -> None:
    post = {"methods": ["POST"], "responses": ERROR_RESPONSES | NOT_FOUND, "response_model": None}
    generating = {**post, "responses": STREAMABLE | ERROR_RESPONSES | NOT_FOUND}
    app.add_api_route("/v1/chat/completions", chat_completions, **generating)
    app.add_api_route("/v1/completions", completions, **generating)
    app.add_api_route("/v1/embeddings", create_embeddings, **post)
    app.add_api_route("/v1/responses", create_response, **generating)
    app.add_api_route(ANTHROPIC_PATH, create_message, **generating)
    app.add_api_route(f"{ANTHROPIC_PATH}/count_tokens", count_message_tokens, **post)
    app.add_api_route("/v1/models", list_models, methods=["GET"], responses=ERROR_RESPONSES)
    app.add_api_route("/v1/models/{model}", get_model, methods=["GET"], responses=ERROR_RESPONSES | NOT_FOUND)
    app.add_api_route("/tokenize", tokenize, **post)
    app.add_api_route("/detokenize", detokenize, **post)
    app.add_api_route("/health", health, methods=["GET"], responses={503: ERROR_RESPONSES[503]})
    app.add_api_route("/ready", readiness, methods=["GET"], responses={503: ERROR_RESPONSES[503]})
    app.add_api_route("/admin/drain", drain, methods=["POST"], status_code=202)
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response)


def _lifespan(pool: ModelPool) -> Callable:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Load after the socket is open: /health says 503 meanwhile instead of refusing connections.
        pool.start()
        # While it loads: the thread pool's first use imports anyio's asyncio back end (~75 ms here),
        # which the first request (a restarted server's) would otherwise pay before it is tokenized.
        await run_in_threadpool(lambda: None)
        yield
        await run_in_threadpool(pool.shutdown)

    return lifespan


def _openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents a 422 for every body; this server answers 400 instead (OpenAI's status)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI caches it after the first call
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    return openapi


def _middleware(app: FastAPI, config: ServerConfig, pool: ModelPool) -> None:
    # The last added runs first: origin/Host guard, CORS (preflights, before auth), body limit, auth.
    if not pool.pinned:
        app.add_middleware(LeaseMiddleware, pool=pool)  # innermost: releases a model once its reply is sent
    app.add_middleware(SessionHeaderMiddleware)  # innermost: x-session-id for the cache-break report
    app.add_middleware(JsonBodyMiddleware)
    if config.api_key:
        # The page's files hold no secret: it loads without the key, then asks for it on a 401.
        open_paths = OPEN_PATHS | WEBUI_PATHS if config.webui else OPEN_PATHS
        open_paths |= {"/metrics"} if config.metrics_public else set()
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"]
        )
    origins, hosts = config.cors_origins, config.allowed_hosts
    app.add_middleware(BrowserGuard, cors_origins=origins, bind_host=config.host, allowed_hosts=hosts)


def create_app(
    engine_factory: Callable[[], LLMEngine] | None,
    config: ServerConfig,
    models: Sequence[ServedModel] = (),
    limits: PoolLimits | None = None,
) -> FastAPI:
    """The app serving one model (`engine_factory`, run on a background thread once the server starts),
    or several (`models`, each loaded on demand within `limits`)."""
    if models:
        pool = ModelPool(models, config, limits or PoolLimits())
    else:
        assert engine_factory is not None
        pool = ModelPool([ServedModel(config, engine_factory)], config, None)
    app = FastAPI(title="localllm", summary="OpenAI-compatible local LLM server", lifespan=_lifespan(pool))
    app.state.pool = pool
    app.state.server = pool.default  # the (first) model's state, as handlers and tests read it
    _routes(app)
    if config.webui:
        add_webui_routes(app)
    app.openapi = _openapi_without_422(app)  # type: ignore[method-assign]
    add_error_handlers(app)
    _middleware(app, config, pool)
    return app
