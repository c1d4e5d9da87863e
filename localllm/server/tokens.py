"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to token ids, and back."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from localllm.server.errors import APIError
from localllm.server.model_pool import model_state
from localllm.server.pipeline import chat_prompt_ids, check_prompt_chars, check_request
from localllm.server.protocol import DetokenizeRequest, TokenizeRequest, check_token_ids


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = await model_state(request, body)
    llm = check_request(state, body).engine
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        ids = await run_in_threadpool(chat_prompt_ids, state, body.messages, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        check_prompt_chars(state, len(body.prompt), None, "prompt")
        ids = await run_in_threadpool(llm.tokenizer.encode, body.prompt, body.add_special_tokens, True)
    result: dict[str, Any] = {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = [llm.tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    return result


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = await model_state(request, body)
    llm = check_request(state, body).engine
    check_token_ids(body.tokens, llm.tokenizer.vocab_size, "tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}
