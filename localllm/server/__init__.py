"""The OpenAI- and Anthropic-compatible HTTP server (`localllm serve`), in floors, lowest first:

errors.py (APIError, both wires' error shapes, the handlers), protocol.py (request models and response
bodies), guards.py (ASGI guards: origin, Host, body limit, API key), streaming.py (SSE framing),
metrics.py; jobs.py (requests on the engine thread); state.py (ServerConfig, ServerState, one per
model); model_pool.py (the served models: loaded on demand, leased, unloaded when idle);
pipeline.py (validation, parameters, prompts, submission); one module per endpoint family (chat,
completions, embeddings, responses, messages, models, tokens, health); app.py (the route table, the
lifespan, `create_app`). Imports go down only (tests/test_imports.py checks it).
"""
