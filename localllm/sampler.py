"""Turns one sequence's logits into its next token: penalties, bias, then greedy or random sampling."""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

import numpy as np

from localllm.sampling_params import SamplingParams


def make_generator(seed: int | None) -> np.random.Generator:
    """A per-request generator, so a seeded result never depends on what else runs."""
    return np.random.default_rng(seed)


def token_generator(seed: int | None, shared: np.random.Generator, position: int) -> np.random.Generator:
    """The generator that draws output token `position`. A seeded request draws each token from its own
    stream keyed by (seed, position): how many draws came before it (speculation's accept/reject draws
    vary with draft lengths, which follow measured timings) must not change what a seed gives.
    Unseeded requests keep drawing from their shared generator."""
    if seed is None:
        return shared
    return np.random.default_rng([seed, position])


def penalised(params: SamplingParams) -> bool:
    """Whether apply_penalties changes anything (callers skip building its token lists otherwise)."""
    return bool(params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or params.logit_bias)  # fmt: skip


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, prompt_ids: SequenceLike[int], output_ids: SequenceLike[int]
) -> np.ndarray:
    """Logit bias, llama.cpp's repeat penalty (over the last n tokens of prompt + output), and OpenAI's
    presence/frequency penalties (over the generated tokens)."""
    if not penalised(params):
        return logits
    logits = np.array(logits, dtype=np.float32, copy=True)
    for token_id, bias in params.logit_bias.items():
        if 0 <= token_id < logits.shape[0]:
            logits[token_id] += bias
    if params.repeat_penalty != 1.0:
        history = list(prompt_ids) + list(output_ids)
        window = history if params.repeat_last_n < 0 else history[-params.repeat_last_n :]
        seen = np.unique(np.asarray(window, dtype=np.int64)) if window else np.empty(0, np.int64)
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(output_ids):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts
    return logits


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; otherwise temperature, top-k, top-p and min-p, then one draw."""
    if params.greedy:
        return int(np.argmax(logits))
    candidates, probs = distribution(logits, params)
    return int(candidates[rng.choice(len(probs), p=probs)])


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a non-greedy draw can pick and their probabilities (likeliest first): temperature,
    top-k, top-p and min-p applied. Speculative decoding's acceptance rule reads the same numbers."""
    candidates = _top_k_candidates(logits, params.top_k)
    scaled = logits[candidates].astype(np.float64) / params.temperature
    weights = np.exp(scaled - scaled.max())
    total = weights.sum()
    # Sorting a whole vocabulary every token is slow: sort only the tokens that can survive the cuts.
    survivors = _rank_cut_superset(weights, total, params)
    if survivors is not None:
        candidates, scaled, weights = candidates[survivors], scaled[survivors], weights[survivors]
    order = np.argsort(-scaled, kind="stable")
    candidates, probs = candidates[order], weights[order] / total
    keep = len(probs)
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    return candidates[:keep], probs[:keep] / probs[:keep].sum()


def _rank_cut_superset(weights: np.ndarray, total: float, params: SamplingParams) -> np.ndarray | None:
    """A mask of the candidates that min-p and top-p could keep (all of those they keep, in index
    order, so the stable sort breaks ties as before); None when there is no cut by rank. Weights are
    exp(scaled - max): the likeliest is 1. The margins only ever keep a few more, never fewer."""
    floor = params.min_p * (1 - 1e-9) if params.min_p > 0.0 else 0.0
    n, m = len(weights), 64
    while params.top_p < 1.0 and m < n:
        kth = np.partition(weights, n - m)[n - m]  # the m-th largest weight
        if weights[weights >= kth].sum() >= total * (params.top_p + 1e-9):
            floor = max(floor, kth)
            break
        m *= 8
    return weights >= floor if floor > 0.0 else None


def dense_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """distribution() as a vocabulary-sized vector (zeros outside the candidates); one-hot when greedy."""
    probs = np.zeros(logits.shape[0], dtype=np.float64)
    if params.greedy:
        probs[int(np.argmax(logits))] = 1.0
        return probs
    if params.top_p >= 1.0 and params.min_p == 0.0:  # no cut by rank: skip distribution()'s sort
        candidates = _top_k_candidates(logits, params.top_k)
        scaled = logits[candidates].astype(np.float64) / params.temperature
        p = np.exp(scaled - scaled.max())
        probs[candidates] = p / p.sum()
        return probs
    candidates, p = distribution(logits, params)
    probs[candidates] = p
    return probs


def _top_k_candidates(logits: np.ndarray, top_k: int) -> np.ndarray:
    if 0 < top_k < logits.shape[0]:
        return np.argpartition(-logits, top_k - 1)[:top_k]
    return np.arange(logits.shape[0])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens with their log-probabilities, best first."""
    if k <= 0:
        return []
    idx = np.argpartition(-logprobs, k - 1)[:k]
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in idx]
