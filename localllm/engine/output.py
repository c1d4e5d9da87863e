"""The one output record every front end reads: per-token deltas and the finished request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SampledToken:
    """A token a step emitted for a sequence (ModelRunner.run), with its log-probability when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    text: str  # newly printable text (UTF-8 complete, stop strings held back)
    token_id: int | None  # the token sampled in this step (None when only finishing)
    logprob: TokenLogprob | None
    finished: bool
    # "stop" | "length" | "repetition" (the loop guard) | "closed_to_fit" (budget steering) | "abort"
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft: float | None  # seconds from arrival to the first generated token
    elapsed: float  # seconds from arrival to this output
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # With a reasoning format (SamplingParams.reasoning): `text` is the answer's new text and this the
    # thinking's (localllm/reasoning.py); reasoning_tokens counts the reasoning tokens so far.
    reasoning: str = ""
    reasoning_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    ttft: float | None
    elapsed: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""  # the thinking, kept out of `text` (SamplingParams.reasoning)
    reasoning_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft if self.ttft else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first (llama.cpp's eval rate)."""
        if self.ttft is None or self.generated_tokens < 2 or self.elapsed <= self.ttft:
            return 0.0
        return (self.generated_tokens - 1) / (self.elapsed - self.ttft)
