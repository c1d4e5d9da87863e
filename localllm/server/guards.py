"""ASGI guards in front of the routes: browser origin and Host checks, the request-body limit, the API
key, and reading every POST body as JSON.

Browsers attach `Origin` to every cross-site POST (and `Sec-Fetch-Site` to every request), while
non-browser clients (curl, the `openai` package, other servers) send neither. So:

- a request whose `Origin` is neither in --cors-origins nor this server's own origin is refused (403),
  which stops a web page the user visits from making the machine generate (a `text/plain` POST needs
  no CORS preflight, so CORS alone does not stop it);
- without `Origin`, a `Sec-Fetch-Site: cross-site`/`same-site` request is refused the same way;
- without either, the request is from a program and is served, whatever its Content-Type (curl -d sends
  a form type; the body is still parsed as JSON);
- bound to a loopback address, a `Host` that is not localhost, an IP address, the bound name or one of
  --allowed-hosts is refused (403): a DNS-rebinding page reaches 127.0.0.1 under its own name, and
  its requests are then same-origin. Bound to another address the server is already exposed; protect
  it with --api-key, which no web page has.

`BodyLimitMiddleware` answers a Content-Length over the limit with a 413 before any body is read, and
stops a chunked body once it passes the limit. `ApiKeyMiddleware` checks --api-key (a Bearer token, or
Anthropic's `x-api-key`) on every path but /health (and the chat page's files).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.server.errors import APIError, error_body, error_response

log = logging.getLogger("localllm.server")

CROSS_SITE = frozenset({"cross-site", "same-site"})
OPEN_PATHS = frozenset({"/health", "/ready"})  # with --api-key, everything else (docs, metrics) needs the key
NO_KEY_MESSAGE = (
    "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer KEY)."
)


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body reader passes it through (it turns others into a 400)."""

    code = "request_too_large"


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
    """An OpenAI-shaped error sent before the app runs; logged once per kind per interval."""
    log.info("%s %s -> %d: %s", scope["method"], scope["path"], status, message, extra={"rate_key": code})
    body = error_body(message, "invalid_request_error", None, code)
    await JSONResponse(body, status_code=status)(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a Host header: 'example.com:8080' -> 'example.com', '[::1]:80' -> '::1'."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    name, _, port = host_header.rpartition(":")
    return name if name and port.isdigit() and ":" not in name else host_header


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class BrowserGuard:
    """Refuses cross-site browser requests and, on loopback, DNS-rebinding Host names (see above)."""

    def __init__(
        self, app: ASGIApp, cors_origins: tuple[str, ...], bind_host: str, allowed_hosts: tuple[str, ...]
    ):
        self.app = app
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower() for o in cors_origins}
        self.check_host = is_loopback(bind_host) and "*" not in allowed_hosts
        self.hosts = {h.lower() for h in allowed_hosts} | {bind_host.lower().strip("[]"), "localhost"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(Headers(scope=scope), scope.get("method", "GET"))
            if refusal is not None:
                return await refuse(scope, receive, send, 403, *refusal)
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, method: str = "GET") -> tuple[str, str] | None:
        """(message, code) when the request must be refused, else None. A link followed from another
        site (a top-level GET navigation) may open the chat page: the other site cannot read what it
        loads, and the page's own requests are then same-origin."""
        host = headers.get("host", "")
        if self.check_host and host and not self.host_allowed(host_name(host).lower()):
            hint = f"start the server with --allowed-hosts {host_name(host)} to allow it"
            message = f"the Host '{host}' is not this server's address (DNS rebinding?); {hint}"
            return message, "host_not_allowed"
        origin = headers.get("origin")
        if origin is None:
            navigation = method == "GET" and headers.get("sec-fetch-mode") == "navigate"
            if headers.get("sec-fetch-site") in CROSS_SITE and not navigation:
                return "cross-site browser requests are refused; see --cors-origins", "origin_not_allowed"
            return None
        if self.any_origin or origin.rstrip("/").lower() in self.origins or _same_origin(origin, host):
            return None
        hint = f"start the server with --cors-origins {origin} to allow it"
        return f"cross-origin request from {origin} refused; {hint}", "origin_not_allowed"

    def host_allowed(self, name: str) -> bool:
        return name in self.hosts or name.endswith(".localhost") or _is_ip(name)


def _same_origin(origin: str, host: str) -> bool:
    """A page this server serves (the /docs UI) calling it back."""
    origin = origin.lower()
    return bool(host) and origin in (f"http://{host.lower()}", f"https://{host.lower()}")


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, or as a chunked body passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def message(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(see --max-body-mb)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await refuse(scope, receive, send, 413, self.message(), "request_too_large")
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # raised inside the route: the HTTPException handler answers
                raise BodyTooLarge(413, self.message())
            return message

        await self.app(scope, limited, send)


class ApiKeyMiddleware:
    """Bearer-token check as plain ASGI (a BaseHTTPMiddleware would break disconnect detection)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()  # Anthropic's clients send it bare in x-api-key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given, x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        if secrets.compare_digest(given, self.expected) or secrets.compare_digest(x_api_key, self.key):
            return await self.app(scope, receive, send)
        message = "Incorrect API key provided." if given or x_api_key else NO_KEY_MESSAGE
        error = APIError(message, 401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error_response(error, path=scope["path"])(scope, receive, send)


class JsonBodyMiddleware:
    """Reads POST bodies as JSON whatever the Content-Type says (curl -d sends a form type), as
    llama-server does; a body that is not JSON still gets a clear 400."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
