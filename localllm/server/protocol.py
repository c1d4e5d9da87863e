"""The OpenAI wire format: pydantic request models, their mapping to SamplingParams, and the
non-streaming response bodies (the error shape: errors.py).

Nothing is silent: a request field is honoured, accepted as a documented no-op (NOOP_FIELDS: OpenAI fields
with no local meaning), or refused with a 400 naming it (unknown fields, and OpenAI features not
implemented yet: REFUSED_FIELDS). Numbers reject NaN and infinities and are bounded where the sampler
could overflow, so no client input reaches the engine thread in a form that can fail there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from localllm.sampling_params import OPENAI_DEFAULTS, SamplingParams, resolve_sampling
from localllm.server.errors import APIError

MIN_TEMPERATURE = 1e-5  # below this the softmax overflows; treated as greedy, as vLLM does
SEED_RANGE = 2**64


# -------------------------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False
    include_obfuscation: bool | None = Field(None, description="Accepted; no padding is ever added.")


class ContentPart(BaseModel):
    # Parts other than text are refused by type in message_text; their own keys are not checked here.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) reach the chat template untouched.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


Bias = Annotated[float, Field(ge=-100, le=100)]
NOOP = "Accepted for compatibility; it has no effect locally."
NOT_YET = "Not supported yet: a 400 naming it unless absent or the no-op value."
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# What the server itself gives a chat template; chat_template_kwargs may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


KeepAlive = Annotated[
    str | float | None,
    Field(
        description="Ollama's: how long the model stays loaded after this request, in seconds or as a "
        'duration such as "10m"; 0 unloads it at once, -1 keeps it (a server of several models).',
    ),
]


def _refused(default: Any = None) -> Any:
    return Field(default, description=NOT_YET)


class SamplingRequest(_Request):
    """Fields shared by chat and completions: OpenAI's, then llama.cpp/vLLM extensions."""

    model: str | None = None
    keep_alive: KeepAlive = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(1, ge=1, le=128, description="Choices; they share the prompt's KV blocks.")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=SEED_RANGE)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Bias] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description=NOOP)
    top_k: int | None = Field(None, ge=-1, description="Extension: 0 or -1 = off.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension.")
    repeat_penalty: float | None = Field(None, ge=0.01, le=100, description="Extension (llama.cpp); 1 = off.")
    repetition_penalty: float | None = Field(
        None, ge=0.01, le=100, description="vLLM's name for repeat_penalty."
    )
    ignore_eos: bool | None = Field(False, description="Extension: keep generating past end-of-text.")
    # Constrained decoding extensions, named as vLLM's (grammar: llama-server's name, GBNF or Lark)
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension: a JSON schema.")
    guided_regex: str | None = Field(None, description="Extension: a regular expression.")
    guided_grammar: str | None = Field(None, description="Extension: a GBNF or Lark grammar.")
    guided_choice: list[str] | None = Field(None, description="Extension: one of these strings.")
    grammar: str | None = Field(None, description="Extension (llama-server): a GBNF or Lark grammar.")
    # llama-server's and vLLM's fields that map exactly onto what this server does (docs/server.md's
    # dialect table); the values that would ask for something else are refused in DIALECT.
    n_predict: int | None = Field(None, ge=-1, description="llama-server: max_tokens (-1: no limit).")
    cache_prompt: bool | None = Field(None, description="llama-server: true is what is always done.")
    id_slot: int | None = Field(None, description="llama-server: -1 (any slot) only.")
    timings_per_token: bool | None = Field(None, description="llama-server: false only.")
    return_progress: bool | None = Field(None, description="llama-server: false only.")
    min_tokens: int | None = Field(None, ge=0, description="vLLM: no end-of-text before this many tokens.")
    skip_special_tokens: bool | None = Field(None, description="vLLM: false keeps special tokens' text.")
    # What vllm-router and sglang-router add to every request they forward, at these values (docs/scaling.md)
    no_stop_trim: bool | None = Field(None, description="SGLang: false only (stop strings are trimmed).")
    return_hidden_states: bool | None = Field(None, description="SGLang: false only.")

    # field -> the values that mean "not used" (accepted); any other value is a 400 naming the field
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # dialect field -> (the values honoured, why another cannot be)
    DIALECT: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "cache_prompt": (
            (None, True),
            "prefix caching is always on here; it cannot be turned off per request",
        ),
        "id_slot": ((None, -1), "there are no slots to pin a request to (the prefix cache is shared)"),
        "timings_per_token": ((None, False), "per-token timings are not reported"),
        "return_progress": ((None, False), "prompt progress is not streamed"),
        "no_stop_trim": ((None, False), "a stop string is always trimmed from the reply"),
        "return_hidden_states": ((None, False), "hidden states are not returned"),
    }
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # OpenAI's when the client gives none (None: no limit)

    def check_supported(self) -> None:
        """A 400 naming the first field asking for something this server does not do (yet)."""
        self.check_n()
        for name, accepted in self.REFUSED.items():
            value = getattr(self, name)
            if not any(value == ok for ok in accepted):
                raise APIError(f"'{name}' is not supported by this server yet", param=name)
        for name, (accepted, why) in self.DIALECT.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise APIError(f"'{name}': {value!r} cannot be honoured: {why}", param=name)
        self.fold_n_predict()
        limit = self.given_max_tokens()
        if self.min_tokens and limit is not None and limit >= 0 and self.min_tokens > limit:
            raise APIError(
                f"min_tokens ({self.min_tokens}) is more than max_tokens ({limit})", param="min_tokens"
            )

    def given_max_tokens(self) -> int | None:
        return self.max_tokens

    def fold_n_predict(self) -> None:
        """llama-server's n_predict as max_tokens (-1: no limit, as when none is given to chat)."""
        if self.n_predict is None:
            return
        given = self.given_max_tokens()
        if given is not None and given != self.n_predict:
            raise APIError("give max_tokens or n_predict, not both", param="n_predict")
        if self.n_predict == 0 and not isinstance(self, CompletionRequest):
            raise APIError("n_predict must be at least 1 here (or -1: no limit)", param="n_predict")
        self.max_tokens = None if self.n_predict == -1 else self.n_predict

    def reserved(self, max_tokens: int | None) -> int | None:
        """The completion tokens the prompt must leave room for, checked up front: OpenAI's max_tokens
        (a 400 when prompt and it overflow the context); none for llama-server's n_predict, a cap there:
        the reply stops at the context's end and says `length` (its suite's test_ctx_shift_disabled_*)."""
        return None if self.n_predict is not None else max_tokens

    def default_max_tokens(self) -> int | None:
        """max_tokens when none is given: the endpoint's default, none after n_predict -1."""
        return None if self.n_predict == -1 else self.DEFAULT_MAX_TOKENS

    def check_n(self) -> None:
        """Hook for fields tied to n (completions' best_of)."""

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, model_defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """What the client sent > the model's defaults (models.toml, the GGUF) > OpenAI's (temperature 1,
        top_p 1, no length limit): resolve_sampling's rule, the same the CLI and the Python API apply."""
        t = self.temperature
        repeat = self.repeat_penalty if self.repeat_penalty is not None else self.repetition_penalty
        given = {
            "temperature": None if t is None else (0.0 if t < MIN_TEMPERATURE else t),
            "top_p": None if self.top_p is None else max(self.top_p, 1e-9),  # 0: keep only the top token
            "top_k": None if self.top_k is None else max(self.top_k, 0),
            "min_p": self.min_p,
            "repeat_penalty": repeat,
            "max_tokens": max_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.token_bias(),
            "seed": None if self.seed is None else self.seed % SEED_RANGE,
            "stop": self.stop_strings(),
            "ignore_eos": bool(self.ignore_eos),
            "logprobs": logprobs,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
        }
        return resolve_sampling(
            given, model_defaults, {**OPENAI_DEFAULTS, "max_tokens": self.default_max_tokens()}
        )

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]  # an empty stop string can never match; OpenAI ignores it too

    def token_bias(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        return bias


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, or json_schema (strict or not: the schema is always enforced)"
    )
    # OpenAI fields with no local meaning: accepted and listed in the README
    metadata: dict[str, str] | None = Field(None, description=NOOP)
    store: bool | None = Field(None, description=NOOP)
    service_tier: str | None = Field(None, description=NOOP)
    safety_identifier: str | None = Field(None, description=NOOP)
    prompt_cache_key: str | None = Field(None, description="Accepted; prefix caching is automatic.")
    prompt_cache_retention: str | None = Field(None, description=NOOP)
    prompt_cache_options: dict[str, Any] | None = Field(
        None, description="Accepted; prefix caching is automatic."
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(None, description="Legacy tools.")
    function_call: str | dict[str, Any] | None = Field(None, description="Legacy tool_choice.")
    # Thinking models: passed to the chat template (gpt-oss reads reasoning_effort, Qwen3 enable_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template as `reasoning_effort`."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Extension (vLLM): chat template variables, e.g. {"enable_thinking": false}.'
    )
    reasoning_budget: int | None = Field(
        None, ge=-1, description="Extension: reasoning tokens before thinking is closed (-1: no limit)."
    )
    # vLLM's assistant prefill: the reply continues the final assistant message instead of a new turn
    continue_final_message: bool | None = Field(None, description="vLLM: continue the last assistant turn.")
    add_generation_prompt: bool | None = Field(None, description="vLLM: false renders no new turn's header.")
    # A thinking model's reasoning is always apart (reasoning_content) and streamed: the routers' true
    separate_reasoning: bool | None = Field(None, description="SGLang: true only.")
    stream_reasoning: bool | None = Field(None, description="SGLang: true only.")
    include_reasoning: bool | None = Field(None, description="vLLM: true only.")
    DIALECT: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = SamplingRequest.DIALECT | {
        "separate_reasoning": ((None, True), "reasoning is always returned apart, as reasoning_content"),
        "stream_reasoning": ((None, True), "reasoning is always streamed, as delta.reasoning_content"),
        "include_reasoning": ((None, True), "reasoning is always returned, as reasoning_content"),
    }
    # OpenAI features not implemented yet
    audio: Any = _refused()
    modalities: Any = _refused()
    prediction: Any = _refused()
    verbosity: Any = _refused()
    web_search_options: Any = _refused()
    moderation: Any = _refused()

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "audio": (None,),
        "modalities": (None, ["text"]),
        "prediction": (None,),
        "verbosity": (None,),
        "web_search_options": (None,),
        "moderation": (None,),
    }

    def check_supported(self) -> None:
        super().check_supported()
        kind = (self.response_format or {"type": "text"}).get("type")
        if kind not in RESPONSE_FORMATS:
            message = f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}"
            raise APIError(message, param="response_format")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if self.messages[-1].role != "assistant":
                raise APIError("continue_final_message needs an assistant message last", param="messages")

    def given_max_tokens(self) -> int | None:
        return self.max_new_tokens()

    def generation_prompt(self) -> bool:
        """Whether the template renders the header of a new assistant turn (not when continuing one)."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return not self.continue_final_message

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort when given."""
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(extra) & TEMPLATE_VARIABLES)
        if reserved:
            message = f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them"
            raise APIError(message, param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
        return extra

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(
        None, ge=0, description="16 when absent, as OpenAI's; 0 scores the prompt."
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = Field(
        None, description="Text after the completion: fill-in-the-middle, for models with FIM tokens."
    )

    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's legacy completions default
    MAX_PROMPTS: ClassVar[int] = 256

    def check_n(self) -> None:
        if self.suffix and self.echo:
            raise APIError("'echo' cannot be used with 'suffix'", param="echo")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise APIError("best_of is not supported (only 1, or equal to n)", param="best_of")
        if len(self.prompts()) * self.num_choices > self.MAX_PROMPTS:
            raise APIError(f"at most {self.MAX_PROMPTS} choices (prompts x n) per request", param="n")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (OpenAI's batch form: a list of texts or of token lists)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > self.MAX_PROMPTS:
                raise APIError(f"at most {self.MAX_PROMPTS} prompts per request", param="prompt")
            return list(prompt)
        return [prompt]  # type: ignore[list-item]

    def generates(self) -> bool:
        """max_tokens 0 only scores (echo) the prompt: no completion is generated."""
        return self.max_tokens != 0


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request (Responses, Messages) translates to; a 400 if invalid."""
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        raise APIError(f"{where}: {first.get('msg')}", param=where.split(".")[0]) from None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    keep_alive: KeepAlive = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    keep_alive: KeepAlive = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------- helpers


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, and `developer` read as `system`."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d["role"] = "system" if m.role == "developer" else m.role
        d["content"] = message_text(m)
        out.append(d)
    return out


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(
                f"content parts of type {part.type!r} are not supported (text only)", param="messages"
            )
        parts.append(part.text)
    return "\n".join(parts)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} is out of range: the vocabulary has {vocab_size} tokens", param=param)


# ------------------------------------------------------------------------------------------- responses


# Engine finish reasons that OpenAI clients do not know, as they go on the wire: the loop guard's
# "repetition" cut the reply short, as max_tokens would, so clients see "length" (the openai client's
# parse() then raises LengthFinishReasonError rather than parsing a cut reply). The engine's own reason
# goes beside it in `native_finish_reason` (OpenRouter's name for a backend's own reason).
# Likewise "closed_to_fit": budget steering (structured/matcher.py) ended a constrained document early, so
# its values are not all the model's: parse() must not accept it.
