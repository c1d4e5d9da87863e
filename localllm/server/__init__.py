"""The OpenAI-compatible HTTP server (`localllm serve`).

app.py (routes, auth, CORS, error handlers, `create_app`), protocol.py (request models and the OpenAI
error shape), streaming.py (SSE chunks), metrics.py (Prometheus collectors and the per-request log line).
"""
