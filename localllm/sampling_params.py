"""SamplingParams: how one request picks its tokens and when it stops (no numpy here: light import)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from localllm.errors import LocalLLMError
from localllm.reasoning import ReasoningSpec
from localllm.structured.spec import StructuredSpec

# The keys a model may set defaults for (models.toml `[models.NAME.defaults]`, GGUF general.sampling.*).
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens")
# Built-in defaults of `run` and the Python API where neither the caller nor the model sets a value
# (llama.cpp's sampling).  `chat` differs only in max_tokens: a reply runs to the end of its turn, up to
# CHAT_MAX_TOKENS (a reply that never ends, as small models' greedy loops do, must not fill the context).
BUILTIN_DEFAULTS: Mapping[str, Any] = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
    "max_tokens": 256,
}
CHAT_MAX_TOKENS = 2048
CHAT_DEFAULTS: Mapping[str, Any] = {**BUILTIN_DEFAULTS, "max_tokens": CHAT_MAX_TOKENS}
# The server's built-ins are OpenAI's: clients expect temperature 1, top_p 1 and no length limit.
OPENAI_DEFAULTS: Mapping[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repeat_penalty": 1.0,
    "max_tokens": None,
}
UNTIL_CONTEXT = -1  # max_tokens = -1: generate until the context is full (the CLI's `-n -1`)
# GGUF metadata keys (written by recent converters from generation_config.json) -> our fields.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
}


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; the rest follow OpenAI/llama.cpp meanings."""

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp style: divides positive logits of seen tokens
    repeat_last_n: int = 64  # window of the repeat penalty; -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 256  # None = until the context is full
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # End-of-text and stop_token_ids cannot end the reply before this many tokens (vLLM's min_tokens;
    # stop strings and a grammar's end still can).
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return per token; 0 = only the chosen
    skip_special_tokens: bool = True
    # End a reply that keeps repeating one span (finish_reason "repetition"); off with ignore_eos, which
    # asks for exactly max_tokens tokens (benchmarks).  See localllm.engine.loop_guard.
    loop_guard: bool = True
    # Constrained decoding: only tokens that keep the output valid for this JSON schema / grammar /
    # regex may be sampled, and the request ends when the output is complete (localllm.structured).
    structured: StructuredSpec | None = None
    # Thinking kept out of the answer: the reply's reasoning goes to `reasoning` of each output, its
    # answer to `text`; a budget forces the model's end-of-thinking marker (localllm.reasoning).
    reasoning: ReasoningSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.temperature >= 0, "temperature must be >= 0")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(self.top_k >= 0, "top_k must be >= 0")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.repeat_penalty > 0, "repeat_penalty must be > 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        _check(all(s for s in self.stop), "stop strings must not be empty")
        _check(len(self.stop) <= MAX_STOPS, f"at most {MAX_STOPS} stop strings may be given")
        longest = max(map(len, self.stop), default=0)
        _check(longest <= MAX_STOP_CHARS, f"a stop string may be at most {MAX_STOP_CHARS:,} characters")
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias may set at most {MAX_LOGIT_BIAS:,} tokens"
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Per-request bounds on what costs the engine thread work per token or per request (OpenAI takes 4 stop
# strings; these are looser, and far below what would cost a request seconds).
MAX_STOPS = 64
MAX_STOP_CHARS = 1_000
MAX_LOGIT_BIAS = 1_024


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise LocalLLMError(message)


def model_sampling_defaults(
    configured: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A model's own sampling defaults: its models.toml entry's keys over the GGUF's general.sampling.*
    ones.  Other keys of `configured` (context, chat_template, ...) are ignored here."""
    values = _gguf_sampling(metadata or {})
    values.update({k: v for k, v in (configured or {}).items() if k in MODEL_DEFAULT_KEYS and v is not None})
    return values


def _gguf_sampling(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF's sampling keys that make sense; a bad value in a file must not fail every request."""
    values: dict[str, Any] = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        raw = metadata.get(key)
        try:
            value = int(raw) if name == "top_k" else float(raw)
            if math.isfinite(value):
                SamplingParams(**{name: value})  # validates the range
                values[name] = value
        except (TypeError, ValueError, LocalLLMError):
            continue
    return values


def resolve_sampling(
    given: Mapping[str, Any],
    model_defaults: Mapping[str, Any] | None = None,
    builtin: Mapping[str, Any] = BUILTIN_DEFAULTS,
) -> SamplingParams:
    """The one rule every front end applies: a value the caller gives (a flag, a request field, a
    keyword; None = not given) > the model's default (models.toml, then the GGUF) > `builtin`.

    `given` may hold any SamplingParams field; max_tokens = -1 means "until the context is full".
    """
    names = {f.name for f in fields(SamplingParams)}
    unknown = set(given) - names
    if unknown:
        raise LocalLLMError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    values = dict(builtin)
    values.update({k: v for k, v in (model_defaults or {}).items() if k in MODEL_DEFAULT_KEYS})
    values.update({k: v for k, v in given.items() if v is not None})
    if values.get("max_tokens") == UNTIL_CONTEXT:
        values["max_tokens"] = None
    return SamplingParams(**values)
