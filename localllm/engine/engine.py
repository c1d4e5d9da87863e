"""LLMEngine: requests in, per-token outputs out. Every front end (run, chat, serve, bench, the Python
API) drives this one engine through add_request / abort / step."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.config import EngineConfig
from localllm.engine.detokenizer import Detokenizer
from localllm.engine.loaded_model import LoadedModel
from localllm.engine.loop_guard import LoopGuard
from localllm.engine.output import RequestOutput, SampledToken, StepOutput, TokenLogprob
from localllm.engine.scheduler import ScheduledSeq, Scheduler
from localllm.engine.sequence import Sequence
from localllm.errors import (
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    KVCacheFullError,
    LocalLLMError,
)
from localllm.reasoning import ReasoningState, marker_ids
from localllm.sampler import make_generator
from localllm.sampling_params import (
    BUILTIN_DEFAULTS,
    SamplingParams,
    model_sampling_defaults,
    resolve_sampling,
)

# What add_request takes as params: complete SamplingParams (used as given), or the values to set
# (a mapping, or None for none), completed by the model's defaults and then the built-ins.
Params = SamplingParams | Mapping[str, Any] | None

log = logging.getLogger("localllm")


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detokenizer: Detokenizer
    stop_ids: frozenset[int]
    guard: LoopGuard | None = None
    reasoning: ReasoningState | None = None  # splits thinking from the answer (params.reasoning)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A moment's counts for monitoring (the server's /metrics), so readers need not know the parts."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use (0-1)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    spec: Any = None  # a copy of spec_decode.SpecStats; None without speculative decoding
    kv_disk: Any = None  # a copy of kv_disk.DiskStats; None without the prefix cache's disk tier


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from localllm.backends import make_backend

        self.config = config
        self.backend = make_backend(config.backend, config.num_threads, config.device)
        loaded = LoadedModel.open(config.model, self.backend, config)
        self.loaded = loaded  # what follows are its parts, by the names front ends and tests use
        self.gguf, self.tokenizer, self.model = loaded.gguf, loaded.tokenizer, loaded.model
        self.args, self.max_model_len = loaded.args, loaded.max_model_len
        self.kv_cache, self.block_manager, self.runner = loaded.kv_cache, loaded.block_manager, loaded.runner
        self.cache_types = self.kv_cache.cache_types
        self.sampling_defaults = model_sampling_defaults(config.sampling_defaults, self.gguf.metadata)
        self.spec = None
        if config.speculative and self.args.recurrent:
            raise ConfigError(
                f"speculative decoding is not supported on {self.args.architecture}: its recurrent state "
                "cannot be rolled back over rejected drafts"
            )
        if config.speculative:
            from localllm.engine.spec_decode import open_spec_decoder

            self.spec = open_spec_decoder(config, loaded)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.spec
        )
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._calls: deque[Callable[[], None]] = deque()  # call_soon: run by the stepping thread
        self._grammars: Any = None  # structured.matcher.GrammarCompiler, made by the first constraint

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_cache.layout.bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    def sampling_params(
        self, given: Mapping[str, Any] | None = None, builtin: Mapping[str, Any] = BUILTIN_DEFAULTS
    ) -> SamplingParams:
        """`given` completed by this model's defaults, then `builtin` (resolve_sampling's one rule)."""
        return resolve_sampling(given or {}, self.sampling_defaults, builtin)

    def add_request(
        self,
        prompt: str | list[int],
        params: Params = None,
        request_id: str | None = None,
        group: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Rejects prompts that cannot fit the context. Requests of one
        `group` (a client request's n choices) share the scheduler's fair share of sequences."""
        if not isinstance(params, SamplingParams):
            params = self.sampling_params(params)
        ids = self.tokenize_prompt(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
        self.check_prompt(len(ids))  # max_tokens is a cap here: generation also stops at the context
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise LocalLLMError(f"request id '{request_id}' is already in use")
        seq = Sequence(request_id, ids, params, make_generator(params.seed), group)
        if params.structured is not None:
            budget = self.max_model_len - len(ids)  # the context's room, or max_tokens when smaller
            budget = budget if params.max_tokens is None else min(params.max_tokens, budget)
            seq.constraint = self.grammars.matcher(params.structured, budget)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.tokenizer.eog_ids
        )
        if params.min_tokens:
            seq.held_stops = sorted(t for t in stop_ids if 0 <= t < self.args.vocab_size)
        reasoning, keep = None, frozenset[int]()
        if params.reasoning is not None:
            keep = marker_ids(params.reasoning, self.tokenizer)
            reasoning = ReasoningState.start(params.reasoning, self.tokenizer, ids)
            self._force_close(seq, reasoning)  # a budget of 0: closed before the first token
        detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens, keep)
        guard = LoopGuard() if params.loop_guard and not params.ignore_eos else None
        self.requests[request_id] = _Request(seq, detok, stop_ids, guard, reasoning)
        self.scheduler.add(seq)
        return request_id

    @staticmethod
    def _force_close(seq: Sequence, reasoning: ReasoningState) -> None:
        """Once the reasoning budget is spent inside the reasoning, the next tokens are its closing
        marker (not with a grammar, whose mask would refuse them)."""
        if seq.constraint is None and reasoning.due():
            seq.forced = list(reasoning.close_ids)

    def close(self) -> None:
        """Let go of what outlives a dropped reference: the disk tier's writer (its queue written out,
        then stopped), the grammar sandbox and threads, the mask thread, and the file pages mapped so
        far. Call it with the engine idle, from the thread that stepped it or after that thread ended;
        the memory goes with the last reference to the engine. Idempotent."""
        if self.block_manager.tier is not None:
            self.block_manager.tier.close()
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None
        self.runner.close()
        self.gguf.release_pages()

    @property
    def grammars(self) -> Any:
        """The compiler (and cache) of this model's constrained-decoding grammars; llguidance loads here,
        with the first constrained request. Thread-safe, so the server compiles before submitting."""
        if self._grammars is None:
            from localllm.structured.matcher import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.args.vocab_size)
        return self._grammars

    def check_token_ids(self, ids: Any) -> list[int]:
        """A prompt given as token ids, each an integer id of this model's vocabulary."""
        ids = list(ids)
        vocab = self.args.vocab_size
        bad = next((t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad!r} is not in this model's vocabulary (0 to {vocab - 1})"
            )
        return [int(t) for t in ids]

    def check_prompt(self, num_tokens: int, max_tokens: int | None = None, what: str = "prompt") -> None:
        """Raises when `num_tokens` of prompt plus `max_tokens` cannot fit this engine's context."""
        check_context_length(self.max_model_len, num_tokens, max_tokens, what)

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request now and free its KV blocks."""
        request = self.requests.pop(request_id, None)
        if request is None or request.seq.is_finished:
            return None
        self.scheduler.finish(request.seq, "abort")
        if self.spec is not None:
            self.spec.release(request_id)
        return self._output(request, "", None, None, time.perf_counter())

    def stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.spec
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            bm.usage,
            bm.num_prefix_queries,
            bm.num_prefix_hits,
            self.scheduler.num_preemptions,
            dataclasses.replace(spec.stats) if spec is not None else None,
            dataclasses.replace(bm.tier.stats) if bm.tier is not None else None,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._calls)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the thread that steps this engine, before its next step (thread-safe): work that
        needs the model between steps, such as prompt_logprobs. `fn` reports its own errors."""
        self._calls.append(fn)

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward pass over the mixed batch, and turn sampled tokens into outputs."""
        try:
            return self._step()
        finally:
            if self.block_manager.events is not None:  # the step's KV events, to a router (kv_events.py)
                self.block_manager.events.flush()

    def _step(self) -> list[StepOutput]:
        while self._calls:
            self._calls.popleft()()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        start = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(plan)
        sampled = self.runner.run(plan.scheduled)
        if self.spec is not None:
            self.spec.record_verified(plan.scheduled, sampled)
        now = time.perf_counter()
        outputs = []
        for item, tokens in zip(plan.scheduled, sampled, strict=True):
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(item.seq)
            self.block_manager.snapshot(item.seq)
            outputs += self._on_tokens(self.requests[item.seq.request_id], item, tokens, now)
        if self.spec is not None:
            self.spec.record_step(plan, now - start)
        return outputs

    def _on_tokens(
        self, request: _Request, item: ScheduledSeq, tokens: list[SampledToken], now: float
    ) -> list[StepOutput]:
        """A step's tokens for one sequence, each through _on_token: one, or a verify step's kept drafts
        and one more. A kept draft's K/V was computed in the step; the rejected ones' is rolled back."""
        seq, outputs = request.seq, []
        for i, token in enumerate(tokens):
            if i:  # the token before was a kept draft
                seq.num_computed_tokens += 1
                if seq.num_computed_tokens % self.block_manager.block_size == 0:
                    self.block_manager.cache_full_blocks(seq)
            outputs.append(self._on_token(request, token, now))
            if seq.is_finished:
                return outputs
        if item.draft:
            self.block_manager.trim(seq, seq.num_tokens)
        return outputs

    def _on_token(self, request: _Request, token: SampledToken, now: float) -> StepOutput:
        seq = request.seq
        seq.append_token(token.token_id)
        if seq.forced and seq.forced[0] == token.token_id:
            seq.forced.pop(0)
        seq.first_token_time = seq.first_token_time or now
        logprob = None
        if token.logprob is not None:
            logprob = TokenLogprob(token.token_id, token.logprob, token.top_logprobs or [])
        done = "stop" if seq.constraint is None else seq.constraint.finish_reason  # steered: not "stop"
        if token.token_id in request.stop_ids:
            return self._finish(request, "", done, token.token_id, logprob, now)
        text, matched = request.detokenizer.add(token.token_id)
        if matched is not None:
            return self._finish(request, text, "stop", matched, logprob, now)
        if seq.constraint is not None and not _advance(seq.constraint, token.token_id):
            tail = text + request.detokenizer.finish()
            return self._finish(request, tail, seq.constraint.finish_reason, None, logprob, now)
        if request.guard is not None and request.guard.add(token.token_id) and not _closes(seq):
            tail = text + request.detokenizer.finish()
            return self._finish(request, tail, "repetition", None, logprob, now)
        params = seq.params
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            return self._finish(request, text + request.detokenizer.finish(), "length", None, logprob, now)
        out = self._output(request, text, token.token_id, logprob, now)
        if request.reasoning is not None:
            self._force_close(seq, request.reasoning)
        return out

    def _finish(
        self, request: _Request, text: str, reason: str, stop: Any, logprob: TokenLogprob | None, now: float
    ) -> StepOutput:
        self.scheduler.finish(request.seq, reason)
        self.requests.pop(request.seq.request_id, None)
        if self.spec is not None:
            self.spec.release(request.seq.request_id)
        out = self._output(request, text, request.seq.token_ids[-1], logprob, now)
        out.stop_reason = stop
        return out

    def _output(
        self, request: _Request, text: str, token_id: int | None, logprob: TokenLogprob | None, now: float
    ) -> StepOutput:
        seq, reasoning, count = request.seq, "", 0
        if request.reasoning is not None:
            generated = token_id is not None and token_id not in request.stop_ids
            reasoning, text = request.reasoning.split(text, generated, seq.is_finished)
            count = request.reasoning.tokens
        return StepOutput(
            request_id=seq.request_id,
            text=text,
            token_id=token_id,
            logprob=logprob,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            generated_tokens=seq.num_output_tokens,
            ttft=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            elapsed=now - seq.arrival_time,
            reasoning=reasoning,
            reasoning_tokens=count,
        )

    def stream(self, prompt: str | list[int], params: Params = None) -> Iterator[StepOutput]:
        """Run one request to the end, yielding its outputs (other queued requests advance too)."""
        request_id = self.add_request(prompt, params)
        try:
            yield from self._drain(request_id)
        finally:
            self.abort(request_id)

    def _drain(self, request_id: str) -> Iterator[StepOutput]:
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def generate(
        self, prompts: list[str | list[int]], params: Params | list[SamplingParams] = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched) and return results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        prompt_ids = {i: self.requests[i].seq.prompt_token_ids for i in ids}
        collected: dict[str, list[StepOutput]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in collected:
                    collected[out.request_id].append(out)
                    if out.finished:
                        pending.discard(out.request_id)
        return [collect_request_output(i, prompt_ids[i], collected[i]) for i in ids]


def _closes(seq: Sequence) -> bool:
    """A looping constrained reply is steered to end its document rather than cut (structured/closing.py)."""
    if seq.constraint is None:
        return False
    if not seq.constraint.closing:
        log.info("%s: the constrained reply loops; steering it to close its document", seq.request_id)
    return seq.constraint.start_closing()


def _advance(constraint: Any, token_id: int) -> bool:
    """Move a sequence's grammar over its new token; False when the output is complete (only the end of
    text may follow) or the grammar failed (logged: the mask makes that a bug, not a user error)."""
    if not constraint.accept(token_id):
        log.warning("constrained decoding stopped: %s", constraint.error)
        return False
    return not constraint.is_finished


def check_context_length(limit: int, num_prompt: int, max_tokens: int | None, what: str = "prompt") -> None:
    """The one prompt-length rule, in OpenAI's words: the prompt (`what`: "prompt" or "messages") must
    leave room for a token, and prompt plus `max_tokens`, when given, must fit the `limit`-token context.

    The engine applies it to every request without max_tokens (there max_tokens is a cap and generation
    also stops at the context, as in llama.cpp); the server passes the request's max_tokens, as OpenAI
    holds a request to it, and the chat session checks its trimmed prompt with it."""
    if num_prompt == 0:
        raise LocalLLMError(f"the {what} {'are' if what.endswith('s') else 'is'} empty")
    head = f"This model's maximum context length is {limit} tokens. However, "
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise ContextLengthExceededError(
            f"{head}you requested {num_prompt + max_tokens} tokens ({num_prompt} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or completion."
        )
    if num_prompt >= limit:
        raise ContextLengthExceededError(
            f"{head}your {what} resulted in {num_prompt} tokens, which leaves no room for the completion. "
            f"Please reduce the length of the {what}."
        )


def collect_request_output(request_id: str, prompt_ids: list[int], outs: list[StepOutput]) -> RequestOutput:
    last = outs[-1]
    tokens = [o.token_id for o in outs if o.token_id is not None]
    if isinstance(last.stop_reason, int):  # a stop token ended it (a steered document's too)
        tokens = tokens[:-1]  # the stop token is not part of the completion
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        text="".join(o.text for o in outs),
        token_ids=tokens,
        finish_reason=last.finish_reason,
        cached_tokens=last.cached_tokens,
        ttft=last.ttft,
        elapsed=last.elapsed,
        logprobs=[o.logprob for o in outs if o.logprob is not None],
        reasoning="".join(o.reasoning for o in outs),
        reasoning_tokens=last.reasoning_tokens,
    )


def score_tokens(engine: LLMEngine, token_ids: list[int], positions: Any = None) -> Any:
    """Logits at every position of `token_ids` in one pass (teacher forcing, perplexity), or only at
    `positions` (perplexity scores half a chunk: the lm head and the logits held shrink to that half).

    Goes through the same block manager, runner and KV cache as generation; the blocks are freed after.
    """
    engine.check_prompt(len(token_ids))
    seq = Sequence("score", list(token_ids), SamplingParams(temperature=0))
    if not engine.block_manager.allocate(seq, len(token_ids)):
        raise KVCacheFullError("not enough free KV cache blocks to score this sequence")
    try:
        batch = engine.runner.prepare([ScheduledSeq(seq, len(token_ids))])
        everywhere = np.arange(len(token_ids), dtype=np.int64)
        batch.logits_indices = everywhere if positions is None else everywhere[np.asarray(positions)]
        return engine.backend.to_numpy(engine.model.forward(batch, engine.kv_cache))
    finally:
        engine.block_manager.free(seq)


def prompt_logprobs(
    engine: LLMEngine, token_ids: list[int], num_top: int = 0, chunk: int = 128
) -> list[TokenLogprob | None]:
    """The log-probability of each prompt token given the ones before it (None for the first), with the
    `num_top` likeliest alternatives: one prefill in chunks of `chunk` positions, so that the logits held
    at once stay small whatever the prompt's length. The blocks are freed after; nothing is cached."""
    from localllm.sampler import log_softmax, top_logprobs

    engine.check_prompt(len(token_ids))
    seq = Sequence("prompt-logprobs", list(token_ids), SamplingParams(temperature=0))
    if not engine.block_manager.allocate(seq, len(token_ids)):
        raise KVCacheFullError("not enough free KV cache blocks to score this prompt")
    out: list[TokenLogprob | None] = [None]
    try:
        while seq.num_computed_tokens < len(token_ids):
            start, n = seq.num_computed_tokens, min(chunk, len(token_ids) - seq.num_computed_tokens)
            batch = engine.runner.prepare([ScheduledSeq(seq, n)])
            batch.logits_indices = np.arange(n, dtype=np.int64)
            logits = engine.backend.to_numpy(engine.model.forward(batch, engine.kv_cache))
            for row, nxt in enumerate(token_ids[start + 1 : start + n + 1]):
                logps = log_softmax(logits[row])  # as the sampler computes a generated token's
                out.append(TokenLogprob(nxt, float(logps[nxt]), top_logprobs(logps, num_top)))
            seq.num_computed_tokens += n
    finally:
        engine.block_manager.free(seq)
    return out
