"""The OpenAI-compatible HTTP server: routes, auth, CORS and error handlers around one AsyncEngine.

`create_app(engine_factory, config)` returns the FastAPI app. The engine loads on a background thread
when the app starts, so /health answers 503 while the model loads and 200 once it serves. Each
handler runs parse -> validate -> run -> format; every client mistake becomes a 4xx in OpenAI's
error shape, and a request whose client goes away is aborted at once so its KV blocks come back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from localllm.engine.async_engine import AsyncEngine, QueueFull
from localllm.engine.engine import LLMEngine, prompt_logprobs
from localllm.engine.output import StepOutput, TokenLogprob
from localllm.errors import LocalLLMError
from localllm.sampling_params import SamplingParams
from localllm.server.embeddings import create_embeddings
from localllm.server.guards import BodyLimitMiddleware, BrowserGuard
from localllm.server.jobs import (
    CLIENT_CLOSED,
    ChatRun,
    EventStream,
    Job,
    collect,
    events,
    run_on_engine,
    shutting_down,
    submit_choices,
    total_usage,
)
from localllm.server.messages import PATH as MESSAGES_PATH
from localllm.server.messages import anthropic_error, count_message_tokens, create_message
from localllm.server.metrics import ServerMetrics
from localllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    SamplingRequest,
    TokenizeRequest,
    chat_choice,
    chat_logprobs,
    chat_response,
    check_token_ids,
    completion_choice,
    completion_logprobs,
    completion_response,
    error_body,
    join_logprobs,
    message_dicts,
    token_logprobs,
)
from localllm.server.responses import create_response
from localllm.server.streaming import ChunkBuilder
from localllm.server.structured_output import constrained_params
from localllm.server.tool_calls import ToolPlan, prepare_messages, tool_plan
from localllm.server.tool_stream import tool_stream
from localllm.server.webui import WEBUI_PATHS, add_webui_routes
from localllm.tokenizer.fim import fim_tokens, infill_ids

log = logging.getLogger("localllm.server")

OPEN_PATHS = frozenset({"/health"})  # with --api-key, everything else (docs and metrics too) needs the key
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    503: {"model": ErrorResponse, "description": "Loading, or the queue is full"},
}
NO_KEY_MESSAGE = (
    "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer KEY)."
)


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs besides the engine, built at the CLI edge."""

    model_id: str  # the served name (registry name or file stem)
    model_aliases: tuple[str, ...] = ()  # other names accepted in `model` (e.g. the file name)
    served_aliases: tuple[str, ...] = ()  # --alias: accepted and listed in /v1/models too
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted on a loopback bind besides localhost and IPs
    max_body_bytes: int = 4 * 2**20
    max_queue: int = 0  # waiting requests allowed before 503; 0 = unbounded
    chat_template: str | None = None  # Jinja text overriding the model's template
    host: str = "127.0.0.1"  # for the banner only; uvicorn binds
    port: int = 8080
    webui: bool = True  # the chat page at / (--no-webui: 404 there)
    on_load_error: Callable[[BaseException], None] | None = None  # the CLI stops the server

    def accepts_model(self, name: str | None) -> bool:
        if name is None:
            return True
        names = {self.model_id, *self.model_aliases, *self.served_aliases}
        return name in names or name.lower() in {n.lower() for n in names}


# ----------------------------------------------------------------------------------------------- state


class ServerState:
    """The engine once loaded, the chat template, and the metrics; shared by all handlers."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine: AsyncEngine | None = None
        self.template: Any = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self.max_token_bytes = 0  # the longest token's text: bounds a prompt's tokens before tokenizing
        self.fingerprint: str | None = None  # system_fingerprint, once loaded
        self.jobs: set[Job] = set()  # submitted and not yet closed: told when the server shuts down
        self.scoring: set[asyncio.Future] = set()  # prompt scores awaited from the engine thread: likewise
        self._closing = False

    @property
    def llm(self) -> LLMEngine:
        return self.ready().engine

    async def start_chat(self, body: ChatCompletionRequest, prefix: str) -> ChatRun:
        """The chat pipeline for endpoints that speak another API (server/responses.py, messages.py)."""
        return await start_chat(self, body, prefix)

    async def chat_prompt_length(self, body: ChatCompletionRequest) -> int:
        """The tokens of a chat request's prompt, tools included (Anthropic's count_tokens)."""
        check_request(self, body)
        tools = tool_plan(body, self.template.source) if self.template is not None else None
        return len(await run_in_threadpool(chat_prompt_ids, self, body.messages, True, None, tools))

    def check_model(self, name: str | None) -> None:
        """The 404 for a model name this server does not serve (None: the served model)."""
        if not self.config.accepts_model(name):
            raise model_not_found(self.config, name)

    def load(self, factory: Callable[[], LLMEngine]) -> None:
        """Runs on a background thread: build the engine, then start serving."""
        from localllm.tokenizer.chat_template import resolve_chat_template

        try:
            started = time.perf_counter()
            llm = factory()
            self.template = resolve_chat_template(llm.gguf.metadata, configured=self.config.chat_template)
            self.max_token_bytes = longest_token(llm)
            self.fingerprint = system_fingerprint(llm)
            engine = AsyncEngine(llm, self.config.max_queue)
        except BaseException as e:  # reported on /health and to the CLI, never lost
            self._load_failed(e)
            return
        if self._closing:
            engine.shutdown()
            return
        self.engine = engine
        log.info("%s", banner(self.config, llm, time.perf_counter() - started))

    def _load_failed(self, error: BaseException) -> None:
        self.load_error = str(error) or type(error).__name__
        log.error(
            "the model failed to load: %s", self.load_error, exc_info=not isinstance(error, LocalLLMError)
        )
        if self.config.on_load_error is not None:
            self.config.on_load_error(error)

    def ready(self) -> AsyncEngine:
        if self._closing:
            raise shutting_down()
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise APIError(
                f"the model failed to load: {self.load_error}", 503, "server_error", code="load_failed"
            )
        raise APIError(
            "the model is loading; retry shortly",
            503,
            "server_error",
            code="model_loading",
            headers={"Retry-After": "2"},
        )

    def begin_shutdown(self) -> None:
        """On the event loop when the server starts its shutdown: new requests get a 503, and each
        open request ends now with an error (an SSE error event and [DONE] for a stream)."""
        self._closing = True
        if self.jobs:
            log.info("shutting down: ending %d open request(s) with an error", len(self.jobs))
        for job in list(self.jobs):
            job.interrupt(shutting_down())
        for future in list(self.scoring):  # the engine thread may stop before it scores them
            if not future.done():
                future.set_exception(shutting_down())

    def shutdown(self) -> None:
        self._closing = True
        if self.engine is not None:
            self.engine.shutdown()


def longest_token(llm: LLMEngine) -> int:
    """The most bytes one token of the vocabulary stands for (special tokens: their text)."""
    tok = llm.tokenizer
    return max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=1) or 1


def system_fingerprint(llm: LLMEngine) -> str:
    """OpenAI's `system_fingerprint`: names what produced a response (localllm's version, the model file,
    backend and KV cache types), so a client can tell when a change may alter outputs."""
    import hashlib
    import os

    from localllm import __version__

    c = llm.config
    name, size = os.path.basename(c.model), os.path.getsize(c.model)
    key = f"{__version__}|{name}|{size}|{c.backend}|{llm.cache_types}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def banner(config: ServerConfig, llm: LLMEngine, load_s: float) -> str:
    c = llm.config
    return (
        f"localllm serving {config.model_id} ({c.model}) | backend {c.backend}, {c.num_threads} threads | "
        f"context {llm.max_model_len} tokens, KV cache {llm.kv_capacity_tokens} tokens, "
        f"{c.max_num_seqs} parallel | loaded in {load_s:.1f} s | http://{config.host}:{config.port}/v1"
        + (f" | chat page http://{config.host}:{config.port}/" if config.webui else "")
    )


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ------------------------------------------------------------------------------------------ validation


def check_request(
    state: ServerState, body: SamplingRequest | TokenizeRequest | DetokenizeRequest
) -> AsyncEngine:
    engine = state.ready()
    state.check_model(body.model)
    if isinstance(body, SamplingRequest):
        body.check_supported()
    return engine


def model_not_found(config: ServerConfig, name: str | None) -> APIError:
    """OpenAI's 404 for a model name it does not know."""
    served = ", ".join(f"'{n}'" for n in (config.model_id, *config.served_aliases))
    message = f"The model '{name}' does not exist; this server serves {served}"
    return APIError(message, 404, param="model", code="model_not_found")


def check_context(llm: LLMEngine, num_prompt: int, max_tokens: int | None, param: str) -> None:
    """The engine's one prompt-length rule, checked before the job so that a prompt that does not fit
    is a 400 naming `param` ("messages" or "prompt"), not an error inside a 200 stream."""
    try:
        llm.check_prompt(num_prompt, max_tokens, param)
    except LocalLLMError as e:
        code = getattr(e, "code", None)
        raise APIError(str(e), param=param, code=None if code == "invalid_request_error" else code) from None


def build_params(
    llm: LLMEngine, body: SamplingRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    params = body.sampling_params(
        max_tokens,
        None if logprobs is None else min(logprobs, llm.tokenizer.vocab_size),
        llm.sampling_defaults,
    )
    check_token_ids(list(params.logit_bias), llm.tokenizer.vocab_size, "logit_bias")
    return params


def check_prompt_chars(state: ServerState, num_chars: int, max_tokens: int | None, param: str) -> None:
    """Refuse, before tokenizing it, a text that cannot fit the context (a 10 MB prompt costs a
    CPU-minute to tokenize). Sound for any tokenizer: a token stands for at most `max_token_bytes`
    bytes of text and a character is at least one byte, so n characters are at least
    ceil(n / max_token_bytes) tokens. Prompts the bound lets through get the exact check after."""
    limit = state.llm.max_model_len
    least = -(-num_chars // max(state.max_token_bytes, 1))
    needed = least + (max_tokens or 0)
    if needed < limit or (max_tokens is not None and needed == limit):
        return
    if max_tokens is None:
        asked = f"{least} tokens in the prompt, leaving no room for the completion"
    else:
        asked = f"{needed} tokens (at least {least} in the prompt, {max_tokens} for the completion)"
    raise APIError(
        f"This model's maximum context length is {limit} tokens. However, you requested at least {asked}: "
        f"{num_chars} characters cannot be fewer tokens, as no token of this model stands for more than "
        f"{state.max_token_bytes} bytes. Please reduce the length of the prompt.",
        param=param,
        code="context_length_exceeded",
    )


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
    tools: ToolPlan | None = None,
) -> list[int]:
    from localllm.tokenizer.chat_template import apply_chat_template

    if state.template is None:
        raise APIError("this model has no chat template; use /v1/completions or start with --chat-template")
    dicts, extra = prepare_messages(message_dicts(messages), state.template.source, tools)
    # The bound applies to the rendered text (a template may drop or add text); rendering is cheap.
    rendered = state.template.render(dicts, add_generation_prompt=add_generation_prompt, **extra)
    check_prompt_chars(state, len(rendered), max_tokens, "messages")
    return apply_chat_template(state.llm.tokenizer, state.template, dicts, add_generation_prompt, **extra)


def completion_prompts(
    state: ServerState, llm: LLMEngine, body: CompletionRequest
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text (for echo); with a suffix, the fill-in-the-middle prompt."""
    if body.suffix:
        out = []
        for prompt in body.prompts():
            chars = len(body.suffix) + (len(prompt) if isinstance(prompt, str) else 0)
            check_prompt_chars(state, chars, body.max_tokens, "prompt")
            out.append((infill_prompt(llm, prompt, body.suffix), ""))
        return out
    out = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            check_prompt_chars(state, len(prompt), body.max_tokens, "prompt")
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
    return await run_on_engine(state, lambda llm: prompt_logprobs(llm, ids, num_top))


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


# -------------------------------------------------------------------------------------------- handlers


async def start_chat(state: ServerState, body: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatRun:
    """Validate a chat request, render its prompt (tools included), and submit its choices: what
    /v1/chat/completions, /v1/responses and /v1/messages share."""
    llm = check_request(state, body).engine
    tools = tool_plan(body, state.template.source) if state.template is not None else None
    max_tokens = body.max_new_tokens()
    prompt_ids = await run_in_threadpool(chat_prompt_ids, state, body.messages, True, max_tokens, tools)
    params = build_params(llm, body, body.max_new_tokens(), body.num_logprobs())
    params = await run_in_threadpool(constrained_params, llm, body, params, tools)
    check_context(llm, len(prompt_ids), params.max_tokens, "messages")
    jobs = await submit_choices(state, [prompt_ids], params, body.num_choices, prefix)
    return ChatRun(jobs, prompt_ids, tools)


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
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


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    llm = check_request(state, body).engine
    prompts = await run_in_threadpool(completion_prompts, state, llm, body)
    generates, n = body.generates(), body.num_choices
    params = build_params(llm, body, body.max_tokens if generates else 1, body.logprobs)
    params = await run_in_threadpool(constrained_params, llm, body, params)
    for ids, _ in prompts:
        check_context(llm, len(ids), params.max_tokens if generates else None, "prompt")
    echoes = [await echo_of(state, body, ids, text) for ids, text in prompts for _ in range(n)]
    ids_list = [ids for ids, _ in prompts]
    jobs = await submit_choices(state, ids_list, params, n, "cmpl") if generates else []
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


async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    names = dict.fromkeys((state.config.model_id, *state.config.served_aliases))
    return {"object": "list", "data": [model_card(state, name) for name in names]}


async def get_model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if not state.config.accepts_model(model):
        raise model_not_found(state.config, model)
    listed = model if model in state.config.served_aliases else state.config.model_id
    return model_card(state, listed)


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "localllm"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.engine.max_model_len
    return card


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
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
    state = _state(request)
    llm = check_request(state, body).engine
    check_token_ids(body.tokens, llm.tokenizer.vocab_size, "tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}


async def health(request: Request) -> dict[str, str]:
    _state(request).ready()
    return {"status": "ok"}


async def metrics(request: Request) -> Response:
    content, media_type = _state(request).metrics.render()
    return Response(content, media_type=media_type)


# ---------------------------------------------------------------------------------------------- errors


def _error(
    status: int,
    message: str,
    type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    request: Request | None = None,
    path: str | None = None,
) -> JSONResponse:
    if request is not None:  # uvicorn's access log is off, so refused requests are logged here
        # rate_key: a flood of refusals logs one line per kind per interval (server/logs.py)
        extra = {"rate_key": f"{status}:{code}"}
        log.info("%s %s -> %d: %s", request.method, request.url.path, status, message, extra=extra)
    path = path or (request.url.path if request is not None else "")
    if path.startswith(MESSAGES_PATH):  # Anthropic's clients read Anthropic's error shape
        return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


async def on_api_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, APIError)
    return _error(e.status, e.message, e.type, e.param, e.code, e.headers, request)


async def on_localllm_error(request: Request, e: Exception) -> JSONResponse:
    if isinstance(e, QueueFull):
        return _error(503, str(e), "server_error", None, "queue_full", {"Retry-After": "1"}, request)
    code = getattr(e, "code", None)
    code = None if code == "invalid_request_error" else code  # OpenAI leaves `code` empty for these
    return _error(400, str(e), "invalid_request_error", None, code, None, request)


async def on_validation_error(request: Request, e: Exception) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400 with the offending field in `param`."""
    assert isinstance(e, RequestValidationError)
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        message = f"the request body is not valid JSON: {detail}"
        return _error(400, message, "invalid_request_error", request=request)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'request body'}: {first.get('msg')}"
    if first.get("type") == "extra_forbidden":  # nothing is dropped silently
        message = f"Unrecognized request argument supplied: {param} (this server does not know it)"
    return _error(400, message, "invalid_request_error", param, request=request)


async def on_http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    code = getattr(e, "code", None)  # guards.BodyTooLarge has one
    return _error(e.status_code, str(e.detail), kind, None, code, dict(e.headers or {}), request)


async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path, exc_info=e)
    return _error(500, "internal server error", "server_error", path=request.url.path)


# ------------------------------------------------------------------------------------------------ auth


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
        response = _error(
            401,
            message,
            "invalid_request_error",
            None,
            "invalid_api_key",
            {"WWW-Authenticate": "Bearer"},
            path=scope["path"],
        )
        await response(scope, receive, send)


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


# ------------------------------------------------------------------------------------------------- app


def _lifespan(state: ServerState, factory: Callable[[], LLMEngine]) -> Callable:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Load after the socket is open: /health says 503 meanwhile instead of refusing connections.
        threading.Thread(target=state.load, args=(factory,), name="localllm-load", daemon=True).start()
        yield
        await run_in_threadpool(state.shutdown)

    return lifespan


STREAMABLE = {
    200: {
        "description": "A completion, or Server-Sent Events when stream is true",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


def _routes(app: FastAPI) -> None:
    not_found = {404: {"model": ErrorResponse, "description": "No such model"}}
    post = {"methods": ["POST"], "responses": ERROR_RESPONSES | not_found, "response_model": None}
    generating = {**post, "responses": STREAMABLE | ERROR_RESPONSES | not_found}
    app.add_api_route("/v1/chat/completions", chat_completions, **generating)
    app.add_api_route("/v1/completions", completions, **generating)
    app.add_api_route("/v1/embeddings", create_embeddings, **post)
    app.add_api_route("/v1/responses", create_response, **generating)
    app.add_api_route(MESSAGES_PATH, create_message, **generating)
    app.add_api_route(f"{MESSAGES_PATH}/count_tokens", count_message_tokens, **post)
    app.add_api_route("/v1/models", list_models, methods=["GET"], responses=ERROR_RESPONSES)
    app.add_api_route("/v1/models/{model}", get_model, methods=["GET"], responses=ERROR_RESPONSES | not_found)
    app.add_api_route("/tokenize", tokenize, **post)
    app.add_api_route("/detokenize", detokenize, **post)
    app.add_api_route("/health", health, methods=["GET"], responses={503: ERROR_RESPONSES[503]})
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response)


def _openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents a 422 for every body; this server answers 400 instead (OpenAI's status)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI caches it after the first call
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    return openapi


def create_app(engine_factory: Callable[[], LLMEngine], config: ServerConfig) -> FastAPI:
    """The app; `engine_factory` runs on a background thread once the server starts."""
    state = ServerState(config)
    app = FastAPI(
        title="localllm",
        summary="OpenAI-compatible local LLM server",
        lifespan=_lifespan(state, engine_factory),
    )
    app.state.server = state
    _routes(app)
    if config.webui:
        add_webui_routes(app)
    app.openapi = _openapi_without_422(app)  # type: ignore[method-assign]
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(LocalLLMError, on_localllm_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
    # The last added runs first: origin/Host guard, CORS (preflights, before auth), body limit, auth.
    app.add_middleware(JsonBodyMiddleware)
    if config.api_key:
        # The page's files hold no secret: it loads without the key, then asks for it on a 401.
        open_paths = OPEN_PATHS | WEBUI_PATHS if config.webui else OPEN_PATHS
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"]
        )
    origins, hosts = config.cors_origins, config.allowed_hosts
    app.add_middleware(BrowserGuard, cors_origins=origins, bind_host=config.host, allowed_hosts=hosts)
    return app
