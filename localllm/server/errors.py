"""Every error the server answers, in one place: an exception becomes one `APIError` (status, type,
param, code, headers), which each wire then shapes: OpenAI's {"error": {...}}, or Anthropic's
{"type": "error", "error": {...}} on the Messages API's paths.

`error_of` is that one mapping for answers with an HTTP status; `stream_error_of` is the same for an
error met after a stream's 200 header went out, which can only be told inside the stream. The app
installs `on_error` for every exception (`add_error_handlers`), so a client mistake is a 4xx in its
wire's shape and a bug a 500 that names nothing internal.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm.engine.async_engine import QueueFull
from localllm.errors import LocalLLMError

log = logging.getLogger("localllm.server")

ANTHROPIC_PATH = "/v1/messages"  # the Messages API: its paths answer in Anthropic's error shape
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Documents the error shape in the OpenAPI schema."""

    error: ErrorDetail


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def shutting_down() -> APIError:
    return APIError("the server is shutting down", 503, "server_error", code="server_shutdown")


def draining() -> APIError:
    """New work while the server drains (it finishes what it holds, then exits): try another replica."""
    return APIError(
        "the server is draining: it finishes the requests it holds, then exits; send this one elsewhere",
        503,
        "server_error",
        code="server_draining",
        headers={"Retry-After": "1"},
    )


# ----------------------------------------------------------------------------------- exception -> error


def error_of(e: BaseException, param: str | None = None) -> APIError:
    """The error an exception is answered with; `param` names the field a LocalLLMError is about."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(str(e), 503, "server_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, LocalLLMError):
        code = None if e.code == "invalid_request_error" else e.code  # OpenAI leaves `code` empty for these
        return APIError(str(e), param=param, code=code)
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = getattr(e, "code", None)  # guards.BodyTooLarge has one
        return APIError(str(e.detail), e.status_code, kind, code=code, headers=dict(e.headers or {}))
    return APIError("internal server error", 500, "server_error")


def stream_error_of(e: BaseException) -> APIError:
    """An error met after the 200 header went out: told inside the stream with its own message and code
    (an engine failure there is the only trace of it the client gets)."""
    kind = "invalid_request_error" if isinstance(e, LocalLLMError) else "server_error"
    return APIError(str(e), 500, kind, code=getattr(e, "code", None))


def _validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400 with the offending field in `param`."""
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"the request body is not valid JSON: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'request body'}: {first.get('msg')}"
    if first.get("type") == "extra_forbidden":  # nothing is dropped silently
        message = f"Unrecognized request argument supplied: {param} (this server does not know it)"
    return APIError(message, param=param)


# -------------------------------------------------------------------------------------- error -> wire


def error_response(error: APIError, request: Request | None = None, path: str | None = None) -> JSONResponse:
    """The error in the shape its path's wire speaks; logged when `request` is given."""
    if request is not None:  # uvicorn's access log is off, so refused requests are logged here
        # rate_key: a flood of refusals logs one line per kind per interval (server/logs.py)
        extra = {"rate_key": f"{error.status}:{error.code}"}
        log.info(
            "%s %s -> %d: %s", request.method, request.url.path, error.status, error.message, extra=extra
        )
    path = path or (request.url.path if request is not None else "")
    if path.startswith(ANTHROPIC_PATH):  # Anthropic's clients read Anthropic's error shape
        body = anthropic_error(error.status, error.message)
    else:
        body = error_body(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers or None)


EXPECTED = (APIError, LocalLLMError, RequestValidationError, StarletteHTTPException)


async def on_error(request: Request, e: Exception) -> JSONResponse:
    """The app's handler for every exception a route raises."""
    if isinstance(e, EXPECTED):
        return error_response(error_of(e), request)
    log.exception("internal error on %s", request.url.path, exc_info=e)
    return error_response(error_of(e), path=request.url.path)


def add_error_handlers(app: FastAPI) -> None:
    for kind in (*EXPECTED, Exception):
        app.add_exception_handler(kind, on_error)
