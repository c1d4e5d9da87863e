"""GET /health (503 while the model loads, 200 once it serves) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from localllm.server.state import server_state


async def health(request: Request) -> dict[str, str]:
    server_state(request).ready()
    return {"status": "ok"}


async def metrics(request: Request) -> Response:
    content, media_type = server_state(request).metrics.render()
    return Response(content, media_type=media_type)
