"""Perplexity of a model on a text, computed the way llama.cpp's `llama-perplexity` computes it.

The whole text is tokenized once (BOS added if the model's tokenizer adds one), cut into chunks of
`n_ctx` tokens (a partial last chunk is dropped), and each chunk is scored on its own from an empty KV
cache, its first token replaced by BOS when the tokenizer adds BOS.  Only the second half of a chunk
is scored: the first half is context, so every scored token sees at least n_ctx/2 tokens before it.
The estimate is exp(mean NLL), with the standard error of the mean NLL carried through the exp.

Logits come from the engine's batched prefill (`score_tokens`): the same block manager, runner and KV
cache as generation, never a separate forward loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.partial_file import unwinding_signals


@dataclass(slots=True)
class NLLStats:
    """Running sums of the negative log-likelihoods (llama.cpp's nll, nll2 and count)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nlls: np.ndarray) -> None:
        values = np.asarray(nlls, dtype=np.float64)
        self.nll += float(values.sum())
        self.nll2 += float((values * values).sum())
        self.count += int(values.size)

    @property
    def mean_nll(self) -> float:
        return self.nll / self.count if self.count else math.nan

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll) if self.count else math.nan

    @property
    def nll_stderr(self) -> float:
        """Standard error of the mean NLL: sqrt((E[v^2] - E[v]^2) / (count - 1)), NaN if undefined."""
        if self.count < 2:
            return math.nan
        mean = self.mean_nll
        variance = self.nll2 / self.count - mean * mean
        return math.sqrt(variance / (self.count - 1)) if variance > 0 else math.nan

    @property
    def ppl_stderr(self) -> float:
        """The error of exp(mean NLL) to first order: d exp(x) = exp(x) dx."""
        return self.nll_stderr * self.ppl


@dataclass(slots=True)
class PerplexityResult:
    ppl: float
    ppl_stderr: float
    mean_nll: float
    nll_stderr: float
    n_ctx: int
    n_chunks: int
    n_tokens: int  # tokens in the whole text
    n_scored: int  # tokens whose NLL entered the estimate
    add_bos: bool
    seconds: float
    chunk_ppls: list[float] = field(default_factory=list)  # the running estimate after each chunk

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_text(path: str | Path) -> str:
    """The file's text; one trailing newline dropped, as llama.cpp's `-f` does."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror or e}") from None
    return text[:-1] if text.endswith("\n") else text


def make_chunks(tokens: Sequence[int], n_ctx: int, bos_id: int | None, n_chunks: int = -1) -> list[list[int]]:
    """Whole chunks of n_ctx tokens, each starting with BOS when `bos_id` is given (the tokenizer adds
    BOS); at most `n_chunks` of them when n_chunks >= 0.  Needs at least 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise LocalLLMError(f"--ctx-size must be at least 4 for perplexity, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise LocalLLMError(
            f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
            f"the text tokenizes to only {len(tokens)}"
        )
    count = len(tokens) // n_ctx
    count = count if n_chunks < 0 else min(n_chunks, count)
    chunks = [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(count)]
    if bos_id is not None:
        for chunk in chunks:
            chunk[0] = bos_id
    return chunks


def token_nlls(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, in float64.

    As llama.cpp: the max and the shifted logits in float32, exp in float32, the sum in double."""
    logits = np.asarray(logits, dtype=np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=-1, dtype=np.float64))
    picked = shifted[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)].astype(np.float64)
    return log_sum - picked


def chunk_nlls(logits: np.ndarray, chunk: Sequence[int]) -> np.ndarray:
    """NLLs of the second half of a chunk from `chunk_logits`' rows: the logits at first..n-2 predict
    tokens first+1..n-1."""
    return token_nlls(logits, chunk[len(chunk) // 2 + 1 :])


def chunk_logits(engine: Any, chunk: Sequence[int]) -> np.ndarray:
    """The logits at the scored positions of a chunk only (first..n-2): half the rows of the chunk."""
    from localllm.engine.engine import score_tokens

    return score_tokens(engine, list(chunk), np.arange(len(chunk) // 2, len(chunk) - 1))


ChunkCallback = Callable[[int, int, Any], None]  # (chunks done, chunks in all, stats so far: .ppl ...)


def perplexity(
    engine: Any,
    text: str,
    n_ctx: int = 512,
    n_chunks: int = -1,
    on_chunk: ChunkCallback | None = None,
    save_logits: str | Path | None = None,
) -> PerplexityResult:
    """llama-perplexity's estimate for `text` with chunks of `n_ctx` tokens, on `engine`; with
    `save_logits`, the scored positions' log-probabilities go to that file (logits_file's format) for
    a later `kl_divergence` against this model."""
    tokenizer = engine.tokenizer
    tokens = tokenizer.encode(text, add_special=True, parse_special=False)
    bos_id = tokenizer.bos_id if tokenizer.add_bos else None
    chunks = make_chunks(tokens, n_ctx, bos_id, n_chunks)
    writer = None
    if save_logits is not None:
        from localllm.logits_file import LogitsWriter

        writer = LogitsWriter(save_logits, n_ctx, engine.args.vocab_size, np.asarray(tokens), len(chunks))
    stats, running = NLLStats(), []
    start = time.perf_counter()
    try:
        with unwinding_signals():  # SIGTERM/SIGHUP too reach the finally that drops the file
            for done, chunk in enumerate(chunks, 1):
                logits = chunk_logits(engine, chunk)
                stats.add(chunk_nlls(logits, chunk))
                if writer is not None:
                    writer.add_chunk(logits)
                running.append(stats.ppl)
                if on_chunk is not None:
                    on_chunk(done, len(chunks), stats)
            if writer is not None:
                writer.commit()
    finally:
        if writer is not None:
            writer.discard()
    return PerplexityResult(
        ppl=stats.ppl,
        ppl_stderr=stats.ppl_stderr,
        mean_nll=stats.mean_nll,
        nll_stderr=stats.nll_stderr,
        n_ctx=n_ctx,
        n_chunks=len(chunks),
        n_tokens=len(tokens),
        n_scored=stats.count,
        add_bos=bos_id is not None,
        seconds=time.perf_counter() - start,
        chunk_ppls=running,
    )


def kl_divergence(
    engine: Any, base_logits: str | Path, n_chunks: int = -1, on_chunk: ChunkCallback | None = None
) -> dict[str, Any]:
    """llama-perplexity --kl-divergence: this model against the base model whose log-probabilities
    `perplexity(..., save_logits=)` saved, on the tokens saved with them (the text is not re-read)."""
    from localllm.kld import KLDStats
    from localllm.logits_file import LogitsReader

    reader = LogitsReader(base_logits)
    try:
        _check_base(engine, reader)
        bos_id = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
        count = reader.n_chunk if n_chunks < 0 else min(n_chunks, reader.n_chunk)
        stats = KLDStats()
        start = time.perf_counter()
        for i in range(count):
            chunk = reader.chunk_tokens(i)
            if bos_id is not None:
                chunk[0] = bos_id
            stats.add(chunk_logits(engine, chunk), reader.next_chunk(), chunk[len(chunk) // 2 + 1 :])
            if on_chunk is not None:
                on_chunk(i + 1, count, stats)
    finally:
        reader.close()
    n_ctx = reader.n_ctx
    return {**stats.summary(), "n_ctx": n_ctx, "n_chunks": count, "seconds": time.perf_counter() - start}


def _check_base(engine: Any, reader: Any) -> None:
    if reader.n_vocab != engine.args.vocab_size:
        raise LocalLLMError(
            f"{reader.path} was saved by a model with a vocabulary of {reader.n_vocab} tokens; "
            f"this one has {engine.args.vocab_size}"
        )
    if reader.n_ctx >= engine.max_model_len:
        raise LocalLLMError(f"{reader.path} has chunks of {reader.n_ctx} tokens; the context is smaller")
