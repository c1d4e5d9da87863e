"""POST /v1/chat/completions: OpenAI's chat endpoint, the pipeline's own wire.

The request runs through `pipeline.start_chat`; the reply is one chat.completion, or its chunks as
Server-Sent Events (with tools: each call as it is written, tool_stream.py).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from localllm.server.jobs import CLIENT_CLOSED, EventStream, collect, events
from localllm.server.model_pool import model_state
from localllm.server.pipeline import start_chat
from localllm.server.protocol import ChatCompletionRequest
from localllm.server.replies import chat_choice, chat_logprobs, chat_response, token_logprobs
from localllm.server.streaming import ChunkBuilder
from localllm.server.tool_stream import tool_stream


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = await model_state(request, body)
    run = await start_chat(state, body)
    llm, jobs, tools, n = state.llm, run.jobs, run.tools, body.num_choices
    rid, totals = jobs[0].id, run.usage
    if body.stream:
        chunks = ChunkBuilder(rid, state.config.model_id, llm.tokenizer, "chat.completion.chunk")
        chunks.include_usage, chunks.logprobs = body.include_usage(), bool(body.logprobs)
        chunks.fingerprint = state.fingerprint
        head = [chunks.chat_role(i) for i in range(n)]
        per_output = tool_stream(tools, chunks) if tools is not None else chunks.chat_output
        return EventStream(events(jobs, chunks, head, per_output, totals), jobs)
    results = await collect(jobs, request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for i, outs in enumerate(results):
        logprobs = chat_logprobs(llm.tokenizer, token_logprobs(outs)) if body.logprobs else None
        choice = chat_choice(i, outs, logprobs)
        choices.append(tools.apply(choice) if tools is not None else choice)
    return JSONResponse(chat_response(rid, state.config.model_id, choices, totals(), state.fingerprint))
