"""The pipeline every generating endpoint shares: validate a request, turn it into sampling parameters,
build its prompt, and submit it (vLLM's OpenAIServing role).

/v1/chat/completions, /v1/responses and /v1/messages all run a chat request through `start_chat`;
/v1/completions and /tokenize use the pieces. Each check raises an `APIError` before anything reaches the
engine, so a prompt that does not fit is a 400 naming its field, not an error inside a 200 stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.concurrency import run_in_threadpool

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import LLMEngine
from localllm.errors import LocalLLMError
from localllm.sampling_params import SamplingParams
from localllm.server.cache_breaks import conversation_key
from localllm.server.errors import APIError, error_of
from localllm.server.jobs import ChatRun, submit_choices
from localllm.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    check_token_ids,
    message_dicts,
)
from localllm.server.state import ServerState
from localllm.server.structured_output import compile_spec, constrained_params
from localllm.server.tool_calls import ToolPlan, marker_terminal, prepare_messages, tool_plan
from localllm.structured.tools import harmony_final_grammar, tool_family


def check_request(
    state: ServerState, body: SamplingRequest | TokenizeRequest | DetokenizeRequest
) -> AsyncEngine:
    engine = state.ready()
    state.check_model(body.model)
    if isinstance(body, SamplingRequest):
        body.check_supported()
        check_choice_tokens(body, engine.engine.max_model_len, state.config.max_choice_tokens)
    return engine


def check_choice_tokens(body: SamplingRequest, max_model_len: int, limit: int) -> None:
    """n choices of up to max_tokens each (the context when not given) are at most `limit` tokens."""
    n = body.num_choices
    if n == 1:
        return
    given = body.max_new_tokens() if hasattr(body, "max_new_tokens") else body.max_tokens
    per_choice = given or body.default_max_tokens() or max_model_len
    if n * per_choice > limit:
        raise APIError(
            f"n x max_tokens is {n:,} x {per_choice:,}, over the limit of {limit:,} tokens a request "
            "(--max-choice-tokens): ask for fewer choices or a lower max_tokens",
            param="n",
        )


def check_context(llm: LLMEngine, num_prompt: int, max_tokens: int | None, param: str) -> None:
    """The engine's one prompt-length rule, checked before the job so that a prompt that does not fit
    is a 400 naming `param` ("messages" or "prompt"), not an error inside a 200 stream."""
    try:
        llm.check_prompt(num_prompt, max_tokens, param)
    except LocalLLMError as e:
        raise error_of(e, param) from None


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
    """Refuse, before tokenizing it, a text that cannot fit the context (tokenizing a huge prompt
    ties up a CPU for a long time). Sound for any tokenizer: a token stands for at most `max_token_bytes`
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
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
) -> list[int]:
    """The prompt's token ids; `continue_final`: the last (assistant) message left open, to go on."""
    from localllm.tokenizer.chat_template import apply_chat_template, open_final_message

    if state.template is None:
        raise APIError("this model has no chat template; use /v1/completions or start with --chat-template")
    source = state.template.source
    dicts, extra = prepare_messages(past_reasoning(message_dicts(messages), source), source, tools)
    extra = {**(template_kwargs or {}), **extra}
    # The bound applies to the rendered text (a template may drop or add text); rendering is cheap.
    rendered = state.template.render(dicts, add_generation_prompt=add_generation_prompt, **extra)
    try:
        if continue_final:
            rendered = open_final_message(rendered, dicts[-1].get("content") or "")
    except LocalLLMError as e:
        raise APIError(str(e), param="messages") from None
    check_prompt_chars(state, len(rendered), max_tokens, "messages")
    tokenizer, template = state.llm.tokenizer, state.template
    return apply_chat_template(
        tokenizer, template, dicts, add_generation_prompt, continue_final=continue_final, **extra
    )


# Where templates look for an earlier assistant turn's thinking: Qwen3's and most `reasoning_content`,
# gpt-oss's `thinking`; a client may send either (or OpenRouter's `reasoning`).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def past_reasoning(dicts: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """Assistant messages with their thinking under each name the template reads; the template then
    decides whether to show it to the model (Qwen3's shows only the turns after the last user one)."""
    wanted = [key for key in REASONING_KEYS if key in template_source]
    out = []
    for d in dicts:
        given = next((d[k] for k in REASONING_KEYS if isinstance(d.get(k), str) and d[k]), None)
        if d["role"] == "assistant" and given is not None:
            d = {**d, **{key: given for key in wanted}}
        out.append(d)
    return out


def reasoning_params(
    state: ServerState, body: ChatCompletionRequest, params: SamplingParams, tools: ToolPlan | None = None
) -> SamplingParams:
    """`params` reading the reply's thinking apart, with the request's (or --reasoning-budget's) budget.
    A constrained reply (a schema, a forced call) is all answer: its grammar starts at the first token.
    But a call forced in harmony's framing is read by the harmony parser, which turns it into a call."""
    framed = harmony_call(params, tools) or harmony_answer(state, params)
    if state.reasoning is None or (params.structured is not None and not framed):
        return params
    budget = body.reasoning_budget if body.reasoning_budget is not None else state.config.reasoning_budget
    return dataclasses.replace(params, reasoning=state.reasoning.with_budget(budget))


def harmony_answer(state: ServerState, params: SamplingParams) -> bool:
    """Is the constraint a JSON response_format on a harmony template (framed by harmony_framed)?"""
    spec, template = params.structured, state.template
    return (
        spec is not None
        and spec.name == "response_format"
        and template is not None
        and tool_family(template.source).name == "harmony"
    )


def harmony_framed(state: ServerState, llm: Any, params: SamplingParams) -> SamplingParams:
    """A JSON response_format on a harmony model, as a final-channel message (structured/tools.py)."""
    spec = params.structured
    if not harmony_answer(state, params) or spec is None or spec.kind not in ("json_schema", "json_object"):
        return params
    framed = harmony_final_grammar(spec, lambda marker: marker_terminal(llm.tokenizer, marker))
    compile_spec(llm, framed)
    return dataclasses.replace(params, structured=framed)


def harmony_call(params: SamplingParams, tools: ToolPlan | None) -> bool:
    """Is the constraint a forced call in harmony's framing (structured/tools.harmony_grammar)?"""
    forced = tools is not None and tools.choice != "auto"  # then the constraint is the call's grammar
    return forced and tools.family.name == "harmony" and params.structured is not None


async def chat_prompt_length(state: ServerState, body: ChatCompletionRequest) -> int:
    """The tokens of a chat request's prompt, tools included (Anthropic's count_tokens)."""
    check_request(state, body)
    tools = tool_plan(body, state.template.source) if state.template is not None else None
    ids = await run_in_threadpool(
        chat_prompt_ids,
        state,
        body.messages,
        body.generation_prompt(),
        None,
        tools,
        body.template_kwargs(),
        bool(body.continue_final_message),
    )
    return len(ids)


async def start_chat(state: ServerState, body: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatRun:
    """Validate a chat request, render its prompt (tools included), and submit its choices: what
    /v1/chat/completions, /v1/responses and /v1/messages share."""
    llm = check_request(state, body).engine
    tools = tool_plan(body, state.template.source) if state.template is not None else None
    max_tokens, extra = body.reserved(body.max_new_tokens()), body.template_kwargs()
    prompt_ids = await run_in_threadpool(
        chat_prompt_ids,
        state,
        body.messages,
        body.generation_prompt(),
        max_tokens,
        tools,
        extra,
        bool(body.continue_final_message),
    )
    params = build_params(llm, body, body.max_new_tokens(), body.num_logprobs())
    params = await run_in_threadpool(constrained_params, llm, body, params, tools)
    params = await run_in_threadpool(harmony_framed, state, llm, params)
    params = reasoning_params(state, body, params, tools)
    check_context(llm, len(prompt_ids), body.reserved(params.max_tokens), "messages")
    cache_break = state.cache_breaks.observe(
        conversation_key(body), prompt_ids, len(body.messages), llm.tokenizer.decode
    )
    jobs = await submit_choices(state.submitter, [prompt_ids], params, body.num_choices, prefix)
    return ChatRun(jobs, prompt_ids, tools, cache_break)
