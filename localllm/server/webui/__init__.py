"""The chat page at `/`: a few static files shipped as package data beside this module.

The page is plain HTML, CSS and JavaScript with no build step and no outside host: it talks to this
server's own /v1 API (same origin, so the BrowserGuard lets it through) and keeps conversations in the
browser's localStorage. The files hold no secret, so they are served without the API key; the page asks
for the key when the API answers 401 and sends it as a Bearer token. `--no-webui` leaves the routes out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

# URL path -> (file in the webui folder, media type)
FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.css": ("app.css", "text/css; charset=utf-8"),
    "/webui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
}
WEBUI_PATHS = frozenset(FILES)  # open without the API key

# Only this origin, no inline script, no framing: a reply's text can never run as code, and the page
# cannot reach another host even by mistake.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated with the ETag: a new version shows at once
}


def read_file(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def _handler(content: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    etag = '"' + hashlib.sha256(content).hexdigest()[:16] + '"'
    headers = {**SECURITY_HEADERS, "ETag": etag}

    async def serve(request: Request) -> Response:
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(content, media_type=media_type, headers=headers)

    return serve


def add_webui_routes(app: FastAPI) -> None:
    """GET (and HEAD) routes for the page's files, read once now and kept in memory (they are small)."""
    for path, (name, media_type) in FILES.items():
        endpoint = _handler(read_file(name), media_type)
        app.add_api_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
