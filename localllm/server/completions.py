"""POST /v1/completions: OpenAI's legacy text completions, with llama-server's fill-in-the-middle.

A prompt is a text, token ids, or a batch of either; `suffix` makes it an infill prompt (models with FIM
tokens). `echo` puts the prompt (and, with `logprobs`, its own logprobs, scored on the engine thread)
before each completion; max_tokens 0 only scores the prompt.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from localllm.engine.engine import LLMEngine, prompt_logprobs
from localllm.engine.output import StepOutput, TokenLogprob
from localllm.server.errors import APIError
from localllm.server.jobs import (
    CLIENT_CLOSED,
    EventStream,
    Job,
    collect,
    events,
    run_on_engine,
    submit_choices,
    total_usage,
)
from localllm.server.model_pool import model_state
from localllm.server.pipeline import build_params, check_context, check_prompt_chars, check_request
from localllm.server.protocol import CompletionRequest, check_token_ids
from localllm.server.replies import (
    completion_choice,
    completion_logprobs,
    completion_response,
    join_logprobs,
    token_logprobs,
)
from localllm.server.state import ServerState
from localllm.server.streaming import ChunkBuilder
from localllm.server.structured_output import constrained_params
from localllm.tokenizer.fim import fim_tokens, infill_ids


def completion_prompts(
    state: ServerState, llm: LLMEngine, body: CompletionRequest
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text (for echo); with a suffix, the fill-in-the-middle prompt."""
    if body.suffix:
        out = []
        for prompt in body.prompts():
            chars = len(body.suffix) + (len(prompt) if isinstance(prompt, str) else 0)
            check_prompt_chars(state, chars, body.reserved(body.max_tokens), "prompt")
            out.append((infill_prompt(llm, prompt, body.suffix), ""))
        return out
    out = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            check_prompt_chars(state, len(prompt), body.reserved(body.max_tokens), "prompt")
            out.append((llm.tokenize_prompt(prompt), prompt))
        else:
            check_token_ids(prompt, llm.tokenizer.vocab_size, "prompt")
            out.append((list(prompt), llm.tokenizer.decode(prompt)))
    return out


def infill_prompt(llm: LLMEngine, prefix: str | list[int], suffix: str) -> list[int]:
    """llama-server's /infill prompt for `prefix` and `suffix`; a 400 for a model without FIM tokens."""
    fim = fim_tokens(llm.tokenizer, llm.gguf.metadata)
    if fim is None:
        raise APIError(
            "'suffix' needs a model with fill-in-the-middle tokens (such as Qwen2.5-Coder's "
            "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>); this model has none",
            param="suffix",
        )
    if isinstance(prefix, list):
        check_token_ids(prefix, llm.tokenizer.vocab_size, "prompt")
    return infill_ids(llm.tokenizer, fim, prefix, suffix)


async def score_prompt(state: ServerState, ids: list[int], num_top: int) -> list[TokenLogprob | None]:
    """The prompt's own logprobs (None for its first token), computed on the engine thread between steps."""
    return await run_on_engine(state.submitter, lambda llm: prompt_logprobs(llm, ids, num_top))


async def echo_of(
    state: ServerState, body: CompletionRequest, ids: list[int], text: str
) -> tuple[str, dict[str, Any] | None]:
    """What echo puts before a completion: the prompt's text and, with logprobs, its logprobs."""
    if not body.echo:
        return "", None
    if body.logprobs is None:
        return text, None
    items = await score_prompt(state, ids, body.logprobs)
    scored = [item for item in items if item is not None]
    return text, completion_logprobs(state.llm.tokenizer, scored, 0, first_id=ids[0])


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = await model_state(request, body)
    llm = check_request(state, body).engine
    prompts = await run_in_threadpool(completion_prompts, state, llm, body)
    generates, n = body.generates(), body.num_choices
    params = build_params(llm, body, body.max_tokens if generates else 1, body.logprobs)
    params = await run_in_threadpool(constrained_params, llm, body, params)
    for ids, _ in prompts:
        check_context(llm, len(ids), body.reserved(params.max_tokens) if generates else None, "prompt")
    echoes = [await echo_of(state, body, ids, text) for ids, text in prompts for _ in range(n)]
    ids_list = [ids for ids, _ in prompts]
    jobs = await submit_choices(state.submitter, ids_list, params, n, "cmpl") if generates else []
    rid = jobs[0].id if jobs else f"cmpl-{uuid.uuid4().hex}"  # the first job's: matches its log line
    lens = [len(ids) for ids in ids_list]
    if body.stream:
        return completion_stream(state, body, rid, echoes, jobs, lens)
    results = await collect(jobs, request) if generates else [[] for _ in echoes]
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    pairs = enumerate(zip(echoes, results, strict=True))
    choices = [completion_choice_of(llm, body, i, echo, outs) for i, (echo, outs) in pairs]
    totals = total_usage(jobs, lens, n)
    return JSONResponse(completion_response(rid, state.config.model_id, choices, totals, state.fingerprint))


def completion_choice_of(
    llm: LLMEngine, body: CompletionRequest, index: int, echo: tuple[str, dict | None], outs: list[StepOutput]
) -> dict[str, Any]:
    """One choice: the echoed prompt (and its logprobs) followed by the completion."""
    echo_text, echo_logprobs = echo
    logprobs = None
    if body.logprobs is not None:
        generated = completion_logprobs(llm.tokenizer, token_logprobs(outs), len(echo_text))
        logprobs = join_logprobs(echo_logprobs, generated)
    text = echo_text + "".join(o.text for o in outs)
    return completion_choice(index, text, logprobs, outs[-1].finish_reason if outs else "length")


def completion_stream(
    state: ServerState,
    body: CompletionRequest,
    rid: str,
    echoes: list[tuple[str, dict[str, Any] | None]],
    jobs: list[Job],
    lens: list[int],
) -> EventStream:
    """Echoed prompts first, then each choice's chunks as they come (`index` tells them apart: prompt
    p's choice j is p * n + j)."""
    chunks = ChunkBuilder(rid, state.config.model_id, state.llm.tokenizer, "text_completion")
    chunks.include_usage, chunks.logprobs = body.include_usage(), body.logprobs is not None
    chunks.fingerprint = state.fingerprint
    head = [chunks.completion_text(text, i, lp) for i, (text, lp) in enumerate(echoes) if text]
    if not jobs:  # max_tokens 0: nothing is generated
        head += [chunks.completion_text("", i, None, "length") for i in range(len(echoes))]
    n = body.num_choices
    stream = events(jobs, chunks, head, chunks.completion_output, lambda: total_usage(jobs, lens, n))
    return EventStream(stream, jobs)
