"""Speculative decoding's acceptance rule: which drafted tokens the target model keeps.

The target's logits at a sequence's k+1 verify positions (row j follows draft[:j]) are processed exactly as
a plain step would process them (penalties over the history so far, then temperature/top-k/top-p/min-p).
Greedy: a draft is kept while it is the target's argmax, so the output is the one plain decoding gives.
Sampling: draft d drawn from q is kept with probability min(1, p(d)/q(d)); the first rejection is replaced
by a draw from max(0, p - q) renormalised (Leviathan et al. 2023, Chen et al. 2023), which leaves every
emitted token distributed as p. Prompt-lookup drafts are deterministic: q is one-hot on the draft.
A seeded request instead draws each position's token exactly as plain decoding would (from that position's
own generator) and keeps the draft only when the draw equals it: still distributed as p, and the output is
the very one plain decoding gives with that seed, whatever the draft lengths (which follow timings).
After k kept drafts the last row gives one more token, as a plain step would.
"""

from __future__ import annotations

import numpy as np

from localllm.engine.output import SampledToken
from localllm.engine.sequence import Sequence
from localllm.sampler import (
    apply_penalties,
    dense_distribution,
    log_softmax,
    sample,
    token_generator,
    top_logprobs,
)


def verify_draft(
    seq: Sequence, draft: list[int], logits: np.ndarray, draft_probs: np.ndarray | None = None
) -> list[SampledToken]:
    """The tokens seq emits from one verify step: the kept drafts, then the target's own token.
    `logits` (k+1, vocab); `draft_probs` (k, vocab) the draft model's q rows, None for one-hot drafts."""
    params = seq.params
    history = list(seq.output_token_ids)
    out: list[SampledToken] = []
    for j, row in enumerate(logits):
        processed = apply_penalties(row, params, seq.prompt_token_ids, history)
        if j == len(draft) or params.greedy or params.seed is not None:
            token = sample(processed, params, token_generator(params.seed, seq.rng, len(history)))
        else:
            q = None if draft_probs is None else draft_probs[j]
            token = _accept_or_resample(processed, params, draft[j], q, seq.rng)
        out.append(_sampled(row, token, params.logprobs))
        if j == len(draft) or token != draft[j]:
            break
        history.append(token)
    return out


def _accept_or_resample(
    processed: np.ndarray, params, draft: int, q: np.ndarray | None, rng: np.random.Generator
) -> int:
    """The draft if kept, else a draw from the residual max(0, p - q). A rejection can't return the draft
    itself: rejection needs p(d) < q(d), and the residual is zero there."""
    p = dense_distribution(processed, params)
    q_draft = 1.0 if q is None else float(q[draft])
    if rng.random() * q_draft < p[draft]:
        return draft
    residual = p.copy()
    if q is None:
        residual[draft] = 0.0
    else:
        residual = np.maximum(residual - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q up to rounding: the rejection was a rounding artefact
        return draft
    return int(rng.choice(len(residual), p=residual / total))


def _sampled(logits: np.ndarray, token_id: int, num_top: int | None) -> SampledToken:
    """As ModelRunner._sample reports a token: its log-probability under the raw logits, when asked."""
    if num_top is None:
        return SampledToken(token_id)
    lp = log_softmax(logits)
    return SampledToken(token_id, float(lp[token_id]), top_logprobs(lp, num_top))
