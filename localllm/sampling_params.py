"""SamplingParams: how one request picks its tokens and when it stops (no numpy here: light import)."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.errors import LocalLLMError


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
    logprobs: int | None = None  # number of top alternatives to return per token; 0 = only the chosen
    skip_special_tokens: bool = True

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
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        _check(all(s for s in self.stop), "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise LocalLLMError(message)
