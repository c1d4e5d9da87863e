"""The models one server serves (`localllm serve A B C`), each a `ServerState`, and when they are loaded.

With one model the pool is pinned: the model loads when the server starts and stays (today's `serve`,
/health answering 503 until it is ready). With several, each loads on its first request, while that
request (and any other for it) waits, up to the load timeout; an idle model unloads after its keep-alive
(the server's --keep-alive, or the last request's Ollama-style `keep_alive`); and before a load, the
least recently used idle models are unloaded until the new one fits --max-loaded and the memory budget.
A model picked for eviction while busy finishes what it holds first, taking no new work meanwhile.

Loads and evictions run one at a time (the load lock), so two first requests start one load. A request
holds a lease on its model from `acquire` until its response is sent (`LeaseMiddleware`), so a model
serving a request, or about to, is never unloaded under it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from localllm.engine.engine import LLMEngine
from localllm.server.errors import APIError, draining, shutting_down
from localllm.server.metrics import PoolSample, merged_exposition
from localllm.server.state import ServerConfig, ServerState, close_engine, model_not_found

log = logging.getLogger("localllm.server")

LEASES = "localllm.leases"  # the scope key of the models a request holds
REAP_INTERVAL_S = 0.1  # how often idle models are checked against their keep-alive
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}


def parse_keep_alive(value: str | float | None) -> float:
    """Seconds from Ollama's keep_alive: a number of seconds, or a duration such as "10m", "1h30m" or
    "45s"; negative means forever (math.inf). Raises ValueError for anything else."""
    if value is None or isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if not body or "".join(n + u for n, u in parts) != body or (len(parts) > 1 and not all(parts[0])):
            raise ValueError(f'not a duration: {value!r} (e.g. 300, "5m", "1h30m", -1)')
        seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds != seconds:  # NaN
        raise ValueError(f"not a duration: {value!r}")
    return math.inf if seconds < 0 else seconds


@dataclass(frozen=True)
class ServedModel:
    """One model of the pool: its names and template (`config`, the server's settings otherwise), how
    its engine is made (the one loader, through LLMEngine), and the memory it is estimated to need."""

    config: ServerConfig
    factory: Callable[[], LLMEngine]
    memory_bytes: int = 0


@dataclass(frozen=True)
class PoolLimits:
    """When models load and unload (several models only)."""

    keep_alive: float = 300.0  # seconds an idle model stays loaded (math.inf: forever); Ollama's default
    max_loaded: int = 0  # models loaded at once; 0: no limit
    max_memory: int = 0  # bytes the loaded models' estimates may add up to; 0: no budget
    load_timeout: float = 600.0  # seconds a request waits for its model to load (and for room)


class Member:
    """A model of the pool: its serving state and the pool's bookkeeping about it."""

    def __init__(self, model: ServedModel, keep_alive: float):
        self.model = model
        self.state = ServerState(model.config)
        self.leases = 0  # requests holding it (acquired, response not yet sent)
        self.waiters = 0  # requests waiting for it to load
        self.loading: asyncio.Task | None = None
        self.evicting = False  # picked to unload: takes no new requests until it is unloaded
        self.keep_alive = keep_alive  # the last request's, else the server's
        self.last_used = time.monotonic()
        self.loads = 0
        self.unloads: dict[str, int] = {}  # reason -> count

    @property
    def name(self) -> str:
        return self.model.config.model_id

    @property
    def loaded(self) -> bool:
        return self.state.engine is not None

    @property
    def status(self) -> str:
        if self.loaded:
            return "loaded"  # an evicted one too, until its last request ends
        return "loading" if self.loading is not None else "unloaded"

    def idle(self) -> bool:
        return self.loaded and self.leases == 0 and self.waiters == 0 and self.loading is None


class ModelPool:
    """Every model the server serves; `limits` None pins the only one (loaded at start, never
    unloaded). What the runner and the operator's endpoints ask of the server (drain, in flight,
    shutdown, readiness, metrics) is answered here for all of them."""

    def __init__(self, models: Sequence[ServedModel], config: ServerConfig, limits: PoolLimits | None):
        if not models or (limits is None and len(models) != 1):
            raise ValueError("a pinned pool holds exactly one model")
        self.config = config  # the server's settings (drain timeout, ...)
        self.limits = limits
        keep = limits.keep_alive if limits is not None else math.inf
        self.members = [Member(m, keep) for m in models]
        self._draining = False
        self.on_drain: Callable[[], None] | None = None  # set by the runner: drain, then exit
        self._closing = False
        self._load_lock: asyncio.Lock | None = None  # made on the event loop
        self._reaper: asyncio.Task | None = None

    @property
    def pinned(self) -> bool:
        return self.limits is None

    @property
    def default(self) -> ServerState:
        """The first model's state: the one a request naming no model gets."""
        return self.members[0].state

    # --------------------------------------------------------------------------- server lifecycle

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for member in self.members:
            member.state.draining = value

    def start(self) -> None:
        """On the event loop as the server starts: the pinned model's load, or the idle-model reaper."""
        if self.pinned:
            state = self.default
            factory = self.members[0].model.factory
            threading.Thread(target=state.load, args=(factory,), name="localllm-load", daemon=True).start()
            return
        self._load_lock = asyncio.Lock()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        log.info("%s", self.banner())

    def banner(self) -> str:
        limits, c = self.limits, self.config
        assert limits is not None
        keep = "forever" if limits.keep_alive == math.inf else f"{limits.keep_alive:g} s"
        most = f", at most {limits.max_loaded} loaded" if limits.max_loaded else ""
        budget = f", within {limits.max_memory >> 20} MiB" if limits.max_memory else ""
        return (
            f"localllm serving {len(self.members)} models, each loaded on its first request: "
            f"{', '.join(m.name for m in self.members)} | idle ones unload after {keep}{most}{budget} | "
            f"http://{c.host}:{c.port}/v1" + (f" | chat page http://{c.host}:{c.port}/" if c.webui else "")
        )

    def ready(self) -> None:
        """The 503 of a server not taking work: the pinned model's (loading, failed, stopping), else
        draining or stopping; models served on demand load when asked."""
        if self.pinned:
            self.default.ready()
            return
        if self._closing:
            raise shutting_down()
        if self.draining:
            raise draining()

    def request_drain(self) -> bool:
        if self.on_drain is None:
            return False
        self.on_drain()
        return True

    def in_flight(self) -> int:
        return sum(member.state.in_flight() for member in self.members)

    def begin_shutdown(self) -> None:
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        for member in self.members:
            member.state.begin_shutdown()

    def shutdown(self) -> None:
        self._closing = True
        for member in self.members:
            member.state.shutdown()

    def render_metrics(self) -> tuple[bytes, str]:
        if self.pinned:
            return self.default.metrics.render()
        registries = [member.state.metrics.exposed for member in self.members]
        return merged_exposition(registries, self._pool_samples())

    def _pool_samples(self) -> list[PoolSample]:
        """(name, type, help, labels, value) of each model's load state and counts."""
        out = []
        for m in self.members:
            label = {"model_name": m.name}
            out.append(("model_loaded", "gauge", "1 while the model is loaded.", label, float(m.loaded)))
            out.append(("model_loads", "counter", "Times the model was loaded.", label, float(m.loads)))
            for reason, count in m.unloads.items():
                labels = {**label, "reason": reason}
                out.append(("model_unloads", "counter", "Times it was unloaded.", labels, float(count)))
            if m.state.load_seconds is not None:
                seconds = m.state.load_seconds
                out.append(("model_load_seconds", "gauge", "How long its last load took.", label, seconds))
        return out

    # --------------------------------------------------------------------------------- requests

    def find(self, name: str | None) -> Member | None:
        if name is None:
            return self.members[0]
        return next((m for m in self.members if m.state.config.accepts_model(name)), None)

    def not_found(self, name: str | None) -> APIError:
        if self.pinned:
            return model_not_found(self.default.config, name)
        served = ", ".join(f"'{m.name}'" for m in self.members)
        message = f"The model '{name}' does not exist; this server serves {served}"
        return APIError(message, 404, param="model", code="model_not_found")

    async def acquire(self, request: Request, name: str | None, keep_alive: Any = None) -> ServerState:
        """The state of the model `name` names, loaded, leased to `request` until its response is sent;
        waits while the model loads (or is evicted, then reloads it), up to the load timeout."""
        if self.limits is None:  # pinned: the one model, checked by the pipeline as ever
            if keep_alive is not None and _keep_alive_param(keep_alive) != math.inf:
                raise APIError(
                    "keep_alive: this server keeps its one model loaded while it runs (-1); start it with "
                    "several models to unload idle ones",
                    param="keep_alive",
                )
            return self.default
        self.ready()
        member = self.find(name)
        if member is None:
            raise self.not_found(name)
        keep = self.limits.keep_alive if keep_alive is None else _keep_alive_param(keep_alive)
        member.waiters += 1
        try:
            await self._until_loaded(member)
        finally:
            member.waiters -= 1
        member.leases += 1
        member.keep_alive, member.last_used = keep, time.monotonic()
        request.scope.setdefault(LEASES, []).append(member)
        return member.state

    async def _until_loaded(self, member: Member) -> None:
        assert self.limits is not None
        deadline = time.monotonic() + self.limits.load_timeout
        while not member.loaded or member.evicting:
            self.ready()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _busy(f"the model '{member.name}' did not load within {self.limits.load_timeout:g} s")
            if member.evicting:
                await asyncio.sleep(min(0.02, left))  # it finishes its requests, unloads, then reloads
                continue
            if member.loading is None:
                member.loading = asyncio.get_running_loop().create_task(self._load(member))
            try:
                await asyncio.wait_for(asyncio.shield(member.loading), left)
            except TimeoutError:
                continue
            if member.state.load_error is not None and not member.loaded:
                message = f"the model '{member.name}' failed to load: {member.state.load_error}"
                raise APIError(message, 503, "server_error", code="load_failed")

    def release(self, member: Member) -> None:
        """The request's response is sent: the model's keep-alive runs from now."""
        member.leases -= 1
        member.last_used = time.monotonic()
        if member.idle() and member.keep_alive == 0 and not member.evicting and not self._closing:
            asyncio.get_running_loop().create_task(self._unload(member, "keep_alive"))

    # ---------------------------------------------------------------------------- load and unload

    async def _load(self, member: Member) -> None:
        assert self._load_lock is not None and self.limits is not None
        try:
            async with self._load_lock:
                if member.loaded:
                    return
                await self._make_room(member, time.monotonic() + self.limits.load_timeout)
                await run_in_threadpool(member.state.load, member.model.factory)
                if member.loaded:
                    member.loads += 1
                    member.last_used = time.monotonic()
        finally:
            member.loading = None

    async def _make_room(self, member: Member, deadline: float) -> None:
        """Unload the least recently used models until `member` fits; a busy one is drained first."""
        while not self._fits(member):
            victims = [m for m in self.members if m is not member and m.loaded and m.loading is None]
            victims = [m for m in victims if m.waiters == 0 or m.evicting]
            if not victims:
                if time.monotonic() > deadline:
                    raise _busy("no room to load the model: every loaded model is in use")
                await asyncio.sleep(0.02)
                continue
            victim = min(victims, key=lambda m: (not m.idle(), m.last_used))
            victim.evicting = True
            while victim.leases and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if victim.leases:
                victim.evicting = False
                raise _busy(f"no room to load the model: '{victim.name}' is still in use")
            await self._unload(victim, "evicted")

    def _fits(self, member: Member) -> bool:
        assert self.limits is not None
        loaded = [m for m in self.members if m.loaded and m is not member]
        if not loaded:
            return True  # alone, a model loads even when its estimate is over the budget
        if self.limits.max_loaded and len(loaded) + 1 > self.limits.max_loaded:
            return False
        used = sum(m.model.memory_bytes for m in loaded)
        return not self.limits.max_memory or used + member.model.memory_bytes <= self.limits.max_memory

    async def _unload(self, member: Member, reason: str) -> None:
        if not member.loaded or member.leases or member.loading is not None:
            return  # gone already, or taken again meanwhile
        member.evicting = True  # no request takes it while it closes
        engine = member.state.detach()
        try:
            if engine is not None:
                await run_in_threadpool(close_engine, engine)
                del engine
                await run_in_threadpool(gc.collect)  # a model's objects hold cycles: free its memory now
                member.unloads[reason] = member.unloads.get(reason, 0) + 1
                log.info("unloaded %s (%s)", member.name, reason)
        finally:
            member.evicting = False

    async def _reap(self) -> None:
        """Unload each model idle for longer than its keep-alive."""
        while not self._closing:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for member in self.members:
                if member.idle() and not member.evicting and now - member.last_used >= member.keep_alive:
                    await self._unload(member, "idle")


def _keep_alive_param(value: Any) -> float:
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise APIError(str(e), param="keep_alive") from None


def _busy(message: str) -> APIError:
    return APIError(message, 503, "server_error", code="model_busy", headers={"Retry-After": "2"})


class LeaseMiddleware:
    """Releases the models a request acquired once its response is sent (a stream: once it ended)."""

    def __init__(self, app: ASGIApp, pool: ModelPool):
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for member in scope.pop(LEASES, []):
                self.pool.release(member)


def request_pool(request: Request) -> ModelPool:
    """The pool of the app serving `request` (create_app puts it on app.state)."""
    return request.app.state.pool


async def model_state(request: Request, body: Any) -> ServerState:
    """The state of the model `body` names (`model`, `keep_alive`), loaded and leased to `request`."""
    pool = request_pool(request)
    return await pool.acquire(request, getattr(body, "model", None), getattr(body, "keep_alive", None))
