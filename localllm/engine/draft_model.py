"""The draft model of speculative decoding: a smaller model with the target's vocabulary proposes tokens.

It runs on the target's backend but has its own paged KV cache and BlockManager: the target's pool, its
prefix-cache hashes and its preemptions stay the target's alone. The draft's pool has its own prefix cache
(a new shadow starts from the blocks of an earlier one with the same prefix, e.g. a chat's next turn); only
blocks full of tokens the target kept get a hash, never ones holding drafts. Each target
sequence has a shadow Sequence here holding the same tokens; before drafting, the shadow's K/V catches up
on whatever the target accepted since (its whole prompt the first time), in the first of the k batched
draft passes. Rejected drafts are forgotten by rewinding the shadow's num_computed_tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from localllm.engine.scheduler import ScheduledSeq
from localllm.engine.sequence import Sequence
from localllm.sampler import apply_penalties, dense_distribution

if TYPE_CHECKING:
    from localllm.engine.loaded_model import LoadedModel

Proposal = tuple[list[int], np.ndarray | None]  # drafted tokens, and their q rows when sampled


class DraftModel:
    def __init__(self, loaded: LoadedModel, vocab_size: int):
        """`loaded`: the draft, opened as the target's (LoadedModel.open's `target`); `vocab_size`: the
        target's, over which drafts are chosen."""
        self.model = loaded.model
        self.head_ids = loaded.head_ids
        self.kv = loaded.kv_cache
        self.block_manager = loaded.block_manager
        self.runner = loaded.runner
        self.vocab_size = vocab_size
        self.shadows: dict[str, tuple[Sequence, int]] = {}  # request id -> (shadow, tokens known equal)

    def prefill(self, scheduled: list[ScheduledSeq]) -> None:
        """Keep up with the target's prefill chunks in one pass, so that drafting later only feeds the
        tokens generated since (a prompt's draft prefill lands in the time to first token, not in decode)."""
        items = []
        for item in scheduled:
            shadow = self._sync(item.seq)
            num_new = item.seq.num_computed_tokens + item.num_tokens - shadow.num_computed_tokens
            if num_new > 0 and self.block_manager.allocate(shadow, num_new):
                items.append(ScheduledSeq(shadow, num_new))
        if items:  # (the backend times the draft's steps apart from the target's: thread_governor)
            self.runner.hidden_states(items, np.zeros(1, dtype=np.int64))  # the K/V is what counts
            for item in items:
                item.seq.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(item.seq)  # prompt tokens: the target's own

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Up to k drafted tokens for each (sequence, k), in max(k) batched passes of the draft model
        (the first also catches up on the tokens the target kept since)."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[np.ndarray]] = [[] for _ in requests]
        active = []
        for i, (seq, k) in enumerate(requests):
            shadow = self._sync(seq)
            if self.block_manager.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1):
                active.append((i, shadow, k))
        while active:
            items = [ScheduledSeq(s, s.num_tokens - s.num_computed_tokens) for _, s, _ in active]
            logits = self._forward(items)
            for (i, shadow, _), item, row in zip(active, items, logits, strict=True):
                shadow.num_computed_tokens += item.num_tokens
                token, q = self._choose(shadow, row)
                shadow.append_token(token)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [a for a in active if len(drafts[a[0]]) < a[2]]
        return [(d, np.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)]

    def lag(self, seq: Sequence) -> int:
        """About how many tokens seq's shadow would catch up on before drafting (its drafts the target
        rejected, up to k, are not counted: it is a new sequence's or an idle one's lag that matters)."""
        entry = self.shadows.get(seq.request_id)
        return seq.num_tokens - (entry[0].num_computed_tokens if entry else 0)

    def _sync(self, seq: Sequence) -> Sequence:
        """seq's shadow with seq's tokens; its K/V kept as far as its earlier drafts were accepted."""
        entry = self.shadows.get(seq.request_id)
        if entry is None:
            entry = (self._new_shadow(seq), 0)
        shadow, same = entry
        old, new = shadow.token_ids, seq.token_ids
        while same < min(len(old), len(new)) and old[same] == new[same]:
            same += 1
        shadow.token_ids = list(new)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same)
        self.shadows[seq.request_id] = (shadow, len(new))
        self.block_manager.cache_full_blocks(shadow)  # its computed tokens are all the target's here
        return shadow

    def _new_shadow(self, seq: Sequence) -> Sequence:
        """A shadow of seq, its K/V taken from the draft's prefix cache as far as that holds seq's tokens."""
        shadow = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, seq.rng)
        shadow.token_ids = list(seq.token_ids)
        cached = self.block_manager.find_cached_prefix(shadow)
        if cached and self.block_manager.allocate(shadow, 0, cached):
            shadow.num_computed_tokens = len(cached) * self.block_manager.block_size
        return shadow

    def _forward(self, items: list[ScheduledSeq]) -> np.ndarray:
        batch = self.runner.prepare(items)
        return self.model.backend.to_numpy(self.model.forward(batch, self.kv))

    def _choose(self, shadow: Sequence, row: np.ndarray) -> tuple[int, np.ndarray | None]:
        """The draft token, processed as the target's own sampling would (penalties over the shadow's
        history); with sampling, the distribution q it was drawn from, which the acceptance rule needs.
        A seeded request drafts the likeliest token: its verify keeps a draft only when the target's own
        draw equals it (see spec_verify), and the likeliest token is the draft most often drawn."""
        row = _fit(row, self.vocab_size, self.head_ids)
        params = shadow.params
        processed = apply_penalties(row, params, shadow.prompt_token_ids, shadow.output_token_ids)
        if params.greedy or params.seed is not None:
            return int(np.argmax(processed)), None
        q = dense_distribution(processed, params)
        return int(shadow.rng.choice(len(q), p=q)), q

    def release(self, request_id: str) -> None:
        entry = self.shadows.pop(request_id, None)
        if entry is not None and entry[0].block_table:
            self.block_manager.free(entry[0])


def _fit(row: np.ndarray, vocab_size: int, ids: np.ndarray | None) -> np.ndarray:
    """The draft's logits over the target's vocabulary: a restricted head's scattered to their ids,
    -inf elsewhere (output rows past the token list never win)."""
    if ids is not None:
        full = np.full(vocab_size, -np.inf, dtype=row.dtype)
        full[ids] = row
        return full
    if len(row) >= vocab_size:
        return row[:vocab_size]
    return np.concatenate([row, np.full(vocab_size - len(row), -np.inf, dtype=row.dtype)])
