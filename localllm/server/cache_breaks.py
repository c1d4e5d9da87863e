"""Cache breaks explained: when a conversation's new prompt shares much less with its previous one than
it should, say where they diverged.

Agent clients re-send their whole conversation every turn, and the prefix cache serves what is unchanged;
a timestamp or a checksum near the top of a system prompt silently makes every turn a full prefill. Per
conversation (`prompt_cache_key`, else `user`, else the `x-session-id` header, else a digest of the first
user message) the server remembers the last prompt's token ids. A new prompt that keeps less than half of
the previous one (and loses at least MIN_LOST tokens) is a break: the chat response's
`usage.prompt_tokens_details.cache_break` gives the token index where the two diverge and a few tokens of
text there (`before`: the previous prompt's, `after`: this one's, `context`: what both share just before);
`localllm:prompt_cache_breaks_total` counts breaks in /metrics, and a log line (at most one per
LOG_INTERVAL seconds) names the latest. A conversation keyed only by the digest is compared only when it
grows (at least as many messages as before): two chats that open with the same message are not one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from localllm.server.protocol import ChatCompletionRequest

log = logging.getLogger("localllm.server")

SESSION_HEADER = b"x-session-id"
MAX_CONVERSATIONS = 256  # remembered, least recently seen forgotten first
MIN_LOST = 32  # a break loses at least this many of the previous prompt's tokens
SNIPPET_TOKENS = 8
SNIPPET_CHARS = 80
LOG_INTERVAL = 10.0

_session: ContextVar[str | None] = ContextVar("localllm_session_id", default=None)


class SessionHeaderMiddleware:
    """Makes the request's `x-session-id` header readable below the endpoints (`session_id()`), so the
    pipeline can key conversations by it without every endpoint passing it down."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope.get("headers", ()) if k.lower() == SESSION_HEADER), None)
        token = _session.set(value.decode("latin-1")[:256] if value else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _session.reset(token)


def session_id() -> str | None:
    return _session.get()


def conversation_key(body: ChatCompletionRequest) -> tuple[str, bool] | None:
    """The conversation a chat request continues, and whether the client named it (else it is the
    digest of its first user message); None when there is nothing to key it by."""
    for prefix, value in (("key", body.prompt_cache_key), ("user", body.user), ("session", session_id())):
        if value:
            return f"{prefix}:{value}", True
    first = next((m for m in body.messages if m.role == "user"), None)
    if first is None:
        return None
    text = json.dumps(first.model_dump(mode="json").get("content"), sort_keys=True)
    return "first:" + hashlib.sha256(text.encode()).hexdigest()[:24], False


@dataclass(slots=True)
class _Seen:
    prompt: np.ndarray
    num_messages: int


class CacheBreaks:
    """The last prompt of each conversation, and the breaks found against it."""

    def __init__(
        self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.conversations: OrderedDict[str, _Seen] = OrderedDict()
        self.counter = Counter(
            "localllm:prompt_cache_breaks",
            "Chat prompts that kept under half of their conversation's previous prompt.",
            registry=registry,
        )
        self._lock = threading.Lock()
        self._clock = clock
        self._logged_at = -LOG_INTERVAL
        self._unlogged = 0

    def observe(
        self, key: tuple[str, bool] | None, prompt_ids: Sequence[int], num_messages: int,
        decode: Callable[[list[int]], str],
    ) -> dict[str, Any] | None:  # fmt: skip
        """Remember this prompt as its conversation's latest; the break against the previous one, if
        there is one (as the usage field's dict)."""
        if key is None:
            return None
        name, named = key
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        with self._lock:
            seen = self.conversations.pop(name, None)
            self.conversations[name] = _Seen(prompt, num_messages)
            while len(self.conversations) > MAX_CONVERSATIONS:
                self.conversations.popitem(last=False)
        if seen is None or (not named and num_messages < seen.num_messages):
            return None
        index = shared_prefix(seen.prompt, prompt)
        lost = len(seen.prompt) - index
        if lost < MIN_LOST or index * 2 >= len(seen.prompt):
            return None
        found = describe(seen.prompt, prompt, index, decode)
        self.counter.inc()
        self._log(name, found)
        return found

    def _log(self, name: str, found: dict[str, Any]) -> None:
        now = self._clock()
        if now - self._logged_at < LOG_INTERVAL:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        log.warning(
            "prompt cache break in conversation %s: the prompt diverges from the previous one at token %d "
            "of %d (%r became %r), so the rest is computed again%s",
            name.split(":", 1)[0], found["token_index"], found["previous_prompt_tokens"],
            found["before"], found["after"], more,
        )  # fmt: skip


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading token ids a and b share."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def describe(
    previous: np.ndarray, prompt: np.ndarray, index: int, decode: Callable[[list[int]], str]
) -> dict:
    """The break's usage field: where, and a few tokens of text on each side."""

    def text(ids: np.ndarray) -> str:
        return decode([int(t) for t in ids])

    return {
        "token_index": index,
        "previous_prompt_tokens": len(previous),
        "context": text(prompt[max(0, index - SNIPPET_TOKENS) : index])[-SNIPPET_CHARS:],
        "before": text(previous[index : index + SNIPPET_TOKENS])[:SNIPPET_CHARS],
        "after": text(prompt[index : index + SNIPPET_TOKENS])[:SNIPPET_CHARS],
    }
