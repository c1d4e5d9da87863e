"""The operator's endpoints: GET /health (503 while the model loads, 200 once it serves: llama-server's
meaning), GET /ready (200 only while it takes new work: 503 loading, draining or stopping, what a router or
a Kubernetes readiness probe asks), POST /admin/drain (finish the open requests, then exit) and GET
/metrics (Prometheus, localllm's and vLLM's names)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from localllm.server.errors import APIError
from localllm.server.model_pool import request_pool


async def health(request: Request) -> dict[str, str]:
    pool = request_pool(request)
    if not pool.draining:
        pool.ready()  # the 503 that says why: loading, the load failed, or stopping
    return {"status": "ok"}  # alive; a draining server still answers its open requests


async def readiness(request: Request) -> dict[str, str]:
    request_pool(request).ready()
    return {"status": "ready"}


async def drain(request: Request) -> JSONResponse:
    state = request_pool(request)
    if not state.request_drain():
        raise APIError("this server cannot drain: it was not started by `localllm serve`", 501)
    return JSONResponse({"status": "draining", "in_flight": state.in_flight()}, status_code=202)


async def metrics(request: Request) -> Response:
    content, media_type = request_pool(request).render_metrics()
    return Response(content, media_type=media_type)
