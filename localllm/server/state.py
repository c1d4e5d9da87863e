"""The server's shared state: its configuration (`ServerConfig`, built at the CLI edge) and
`ServerState`, which loads the engine on a background thread, answers whether it serves yet, and ends
the work in flight when the server shuts down. One per served model (model_pool.py holds them); an
endpoint gets its model's through `model_pool.model_state(request, body)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import LLMEngine
from localllm.errors import LocalLLMError
from localllm.reasoning import ReasoningSpec, detect_reasoning
from localllm.server.cache_breaks import CacheBreaks
from localllm.server.errors import APIError, draining, shutting_down
from localllm.server.jobs import Submitter
from localllm.server.metrics import ServerMetrics

log = logging.getLogger("localllm.server")


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs besides the engine, built at the CLI edge."""

    model_id: str  # the served name (registry name or file stem)
    model_aliases: tuple[str, ...] = ()  # other names accepted in `model` (e.g. the file name)
    served_aliases: tuple[str, ...] = ()  # --alias: accepted and listed in /v1/models too
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted on a loopback bind besides localhost and IPs
    max_body_bytes: int = 4 * 2**20
    max_queue: int = 0  # waiting requests allowed before 503; 0 = unbounded
    max_embedding_tokens: int = 65_536  # input tokens of one /v1/embeddings request, all inputs together
    max_choice_tokens: int = 65_536  # n x max_tokens of one request with n > 1
    chat_template: str | None = None  # Jinja text overriding the model's template
    reasoning_budget: int | None = None  # --reasoning-budget: a request's default (None: no limit)
    host: str = "127.0.0.1"  # for the banner only; uvicorn binds
    port: int = 8080
    webui: bool = True  # the chat page at / (--no-webui: 404 there)
    metrics_public: bool = False  # --metrics-public: /metrics without the API key (a router scrapes it)
    drain_timeout: float = 30.0  # --drain-timeout: SIGTERM waits this long for open requests, then ends them
    on_load_error: Callable[[BaseException], None] | None = None  # the CLI stops the server

    def accepts_model(self, name: str | None) -> bool:
        if name is None:
            return True
        names = {self.model_id, *self.model_aliases, *self.served_aliases}
        return name in names or name.lower() in {n.lower() for n in names}


class ServerState:
    """The engine once loaded, the chat template, and the metrics; shared by all handlers."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine: AsyncEngine | None = None
        self.template: Any = None
        self.reasoning: ReasoningSpec | None = None  # how replies split thinking from the answer
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(
            lambda: self.engine.stats() if self.engine is not None else None, config.model_id
        )
        self.max_token_bytes = 0  # the longest token's text: bounds a prompt's tokens before tokenizing
        self.fingerprint: str | None = None  # system_fingerprint, once loaded
        self.load_seconds: float | None = None  # how long the last load took
        self.cache_breaks = CacheBreaks(self.metrics.registry)  # each conversation's last prompt
        self.submitter = Submitter(self.ready, self.metrics)  # what jobs use; told when the server shuts down
        self._closing = False
        self.draining = False  # finishing what it holds; new requests get a 503 (a router sends them on)
        self.on_drain: Callable[[], None] | None = None  # set by the runner: drain, then exit

    @property
    def llm(self) -> LLMEngine:
        return self.ready().engine

    @property
    def max_model_len(self) -> int | None:
        """The context length once the model is loaded (None before)."""
        return self.engine.engine.max_model_len if self.engine is not None else None

    def check_model(self, name: str | None) -> None:
        """The 404 for a model name this server does not serve (None: the served model)."""
        if not self.config.accepts_model(name):
            raise model_not_found(self.config, name)

    def load(self, factory: Callable[[], LLMEngine]) -> None:
        """Runs on a background thread: build the engine, then start serving."""
        from localllm.tokenizer.chat_template import resolve_chat_template

        self.load_error = None  # a model served on demand is tried again after a failed load
        try:
            started = time.perf_counter()
            llm = factory()
            self.template = resolve_chat_template(llm.gguf.metadata, configured=self.config.chat_template)
            source = self.template.source if self.template is not None else None
            self.reasoning = detect_reasoning(source, llm.tokenizer.special_tokens)
            self.max_token_bytes = longest_token(llm)
            self.fingerprint = system_fingerprint(llm)
            engine = AsyncEngine(llm, self.config.max_queue)
        except BaseException as e:  # reported on /health and to the CLI, never lost
            self._load_failed(e)
            return
        if self._closing:
            close_engine(engine)
            return
        self.engine = engine
        self.load_seconds = time.perf_counter() - started
        log.info("%s", banner(self.config, llm, self.load_seconds))

    def detach(self) -> AsyncEngine | None:
        """On the event loop: stop serving the model (requests see it unloaded from now on) and hand
        over its engine for `close_engine`, off the loop."""
        engine, self.engine = self.engine, None
        return engine

    def _load_failed(self, error: BaseException) -> None:
        self.load_error = str(error) or type(error).__name__
        log.error(
            "the model failed to load: %s", self.load_error, exc_info=not isinstance(error, LocalLLMError)
        )
        if self.config.on_load_error is not None:
            self.config.on_load_error(error)

    def ready(self) -> AsyncEngine:
        if self._closing:
            raise shutting_down()
        if self.draining:
            raise draining()
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise APIError(
                f"the model failed to load: {self.load_error}", 503, "server_error", code="load_failed"
            )
        raise APIError(
            "the model is loading; retry shortly",
            503,
            "server_error",
            code="model_loading",
            headers={"Retry-After": "2"},
        )

    def request_drain(self) -> bool:
        """Start draining (the admin call; SIGTERM comes through the runner): False where this server
        was not started by the runner, which owns the exit."""
        if self.on_drain is None:
            return False
        self.on_drain()
        return True

    def in_flight(self) -> int:
        """Requests submitted to the engine and not yet closed, and engine calls awaited."""
        return len(self.submitter.jobs) + len(self.submitter.scoring)

    def begin_shutdown(self) -> None:
        """On the event loop when the server starts its shutdown: new requests get a 503, and each
        open request ends now with an error (an SSE error event and [DONE] for a stream)."""
        self._closing = True
        if self.submitter.jobs:
            log.info("shutting down: ending %d open request(s) with an error", len(self.submitter.jobs))
        self.submitter.interrupt(shutting_down)

    def shutdown(self) -> None:
        self._closing = True
        if self.engine is not None:
            self.engine.shutdown()


def close_engine(engine: AsyncEngine) -> None:
    """Stop the engine's thread, then release what the model holds (LLMEngine.close)."""
    engine.shutdown()
    engine.engine.close()


def server_state(request: Request) -> ServerState:
    """The state of the app serving `request` (create_app puts it on app.state)."""
    return request.app.state.server


def model_not_found(config: ServerConfig, name: str | None) -> APIError:
    """OpenAI's 404 for a model name it does not know."""
    served = ", ".join(f"'{n}'" for n in (config.model_id, *config.served_aliases))
    message = f"The model '{name}' does not exist; this server serves {served}"
    return APIError(message, 404, param="model", code="model_not_found")


def longest_token(llm: LLMEngine) -> int:
    """The most bytes one token of the vocabulary stands for (special tokens: their text)."""
    tok = llm.tokenizer
    return max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=1) or 1


def system_fingerprint(llm: LLMEngine) -> str:
    """OpenAI's `system_fingerprint`: names what produced a response (localllm's version, the model file,
    backend and KV cache types), so a client can tell when a change may alter outputs."""
    import hashlib
    import os

    from localllm import __version__

    c = llm.config
    name, size = os.path.basename(c.model), os.path.getsize(c.model)
    key = f"{__version__}|{name}|{size}|{c.backend}|{llm.cache_types}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def banner(config: ServerConfig, llm: LLMEngine, load_s: float) -> str:
    c = llm.config
    return (
        f"localllm serving {config.model_id} ({c.model}) | backend {c.backend}, {c.num_threads} threads | "
        f"context {llm.max_model_len} tokens, KV cache {llm.kv_capacity_tokens} tokens, "
        f"{c.max_num_seqs} parallel | loaded in {load_s:.1f} s | http://{config.host}:{config.port}/v1"
        + (f" | chat page http://{config.host}:{config.port}/" if config.webui else "")
    )
