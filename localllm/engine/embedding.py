"""Embeddings through the engine: each input's final normed hidden states, pooled, L2-normalised.

Inputs are packed into as few forward passes as the step's token budget and the free KV blocks allow
(64 short texts are one or two prefills), through the same ModelRunner, block manager and KV cache as
generation. The blocks are freed after; nothing is cached. Runs on the thread that steps the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.engine.scheduler import ScheduledSeq
from localllm.engine.sequence import Sequence
from localllm.errors import ContextLengthExceededError, InvalidRequestError, KVCacheFullError, LocalLLMError
from localllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from localllm.engine.engine import LLMEngine

# llama.cpp's `{arch}.pooling_type` values (LLAMA_POOLING_TYPE_*), as embedding models' GGUFs carry them
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLINGS = ("mean", "cls", "last")
# A decoder LLM's file has no pooling type; with causal attention only the last token has seen the whole
# input, so it is what we pool (llama.cpp's `--pooling last`; llama-server's default there is "none",
# which its /v1/embeddings refuses).
DEFAULT_POOLING = "last"


def model_pooling(metadata: Any, architecture: str) -> str:
    """The pooling the model's metadata asks for: mean, cls or last (DEFAULT_POOLING when it says none)."""
    value = metadata.get(f"{architecture}.pooling_type")
    name = POOLING_TYPES.get(int(value)) if isinstance(value, int) else None
    if name == "rank":
        raise LocalLLMError("this model is a reranker (pooling type 'rank'); it has no embeddings")
    return name if name in POOLINGS else DEFAULT_POOLING


@dataclass(slots=True)
class _Pooled:
    """One input in flight: its row of the output and its sequence."""

    index: int
    seq: Sequence


def embed_token_ids(
    engine: LLMEngine, inputs: list[list[int]], pooling: str | None = None, normalize: bool = True
) -> np.ndarray:
    """An (len(inputs), dim) float32 array: each input's pooled final hidden state, unit length when
    `normalize`. Each step packs inputs (long ones in chunks) up to the engine's token budget."""
    pooling = pooling or model_pooling(engine.gguf.metadata, engine.gguf.architecture)
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
    for ids in inputs:
        check_input_length(engine.max_model_len, len(ids))
    out = np.zeros((len(inputs), engine.args.dim), dtype=np.float32)
    waiting = deque(
        _Pooled(i, Sequence(f"embed-{i}", list(ids), SamplingParams(temperature=0)))
        for i, ids in enumerate(inputs)
    )
    active: list[_Pooled] = []
    try:
        while waiting or active:
            _admit(engine, waiting, active)
            _step(engine, active, out, pooling)
            for item in [a for a in active if a.seq.num_computed_tokens == a.seq.num_tokens]:
                engine.block_manager.free(item.seq)
                active.remove(item)
    finally:
        for item in active:
            engine.block_manager.free(item.seq)
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = np.divide(out, norms, out=np.zeros_like(out), where=norms > 0)
    return out


def check_input_length(limit: int, num_tokens: int) -> None:
    """An input must have a token and fit the context (nothing is generated after it)."""
    if num_tokens == 0:
        raise InvalidRequestError("an input to embed is empty")
    if num_tokens > limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {limit} tokens, however you requested "
            f"{num_tokens} tokens in an input. Please reduce the length of the input."
        )


def _admit(engine: LLMEngine, waiting: deque[_Pooled], active: list[_Pooled]) -> None:
    """Give waiting inputs their KV blocks (the whole input at once) while blocks last."""
    while waiting:
        seq = waiting[0].seq
        if not engine.block_manager.allocate(seq, seq.num_tokens):
            if not active:
                raise KVCacheFullError("not enough free KV cache blocks to embed this input")
            return
        active.append(waiting.popleft())


def _step(engine: LLMEngine, active: list[_Pooled], out: np.ndarray, pooling: str) -> None:
    """One forward pass over the next chunk of as many active inputs as the token budget holds."""
    budget = max(engine.config.max_num_batched_tokens, 1)
    scheduled: list[ScheduledSeq] = []
    rows: list[int] = []
    owners: list[_Pooled] = []
    start = 0
    for item in active:
        if budget == 0:
            break
        seq = item.seq
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        scheduled.append(ScheduledSeq(seq, n))
        wanted = _wanted_rows(seq.num_computed_tokens, n, seq.num_tokens, pooling)
        rows += [start + r for r in wanted]
        owners += [item] * len(wanted)
        start += n
        budget -= n
    # The pass runs even when no row is wanted (a long input's middle chunk): it fills the KV cache.
    hidden = engine.runner.hidden_states(scheduled, np.asarray(rows or [0], dtype=np.int64))
    for row, item in enumerate(owners):
        out[item.index] += hidden[row]
    for step in scheduled:
        step.seq.num_computed_tokens += step.num_tokens
    if pooling == "mean":
        for item in {id(o): o for o in owners}.values():
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                out[item.index] /= item.seq.num_tokens


def _wanted_rows(start: int, n: int, total: int, pooling: str) -> list[int]:
    """Which rows of a chunk (positions start..start+n of a `total`-token input) the pooling reads."""
    if pooling == "mean":
        return list(range(n))
    if pooling == "cls":
        return [0] if start == 0 else []
    return [n - 1] if start + n == total else []
