"""ModelRunner: turns a scheduled step into the kernels' inputs, runs one forward pass for the whole
mixed batch, and samples each sequence that reached its last token with its own parameters: one token,
or after drafts (speculative decoding) the acceptance rule's kept drafts and one more (spec_verify)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.backends.base import SampleRow
from localllm.engine.kv_cache import KVCache
from localllm.engine.mask_prefetch import MaskPrefetcher
from localllm.engine.output import SampledToken
from localllm.engine.scheduler import ScheduledSeq
from localllm.engine.sequence import Sequence
from localllm.engine.spec_verify import verify_draft
from localllm.models.base import ForwardBatch
from localllm.sampler import apply_penalties, log_softmax, penalised, sample, token_generator, top_logprobs

if TYPE_CHECKING:
    from localllm.models.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, kv_cache: KVCache):
        self.model = model
        self.backend = model.backend
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self._masks = MaskPrefetcher()

    def close(self) -> None:
        self._masks.close()

    def prepare(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        if all(item.num_tokens == 1 and not item.draft for item in scheduled):
            return self._prepare_decode(scheduled)
        input_ids, positions, slots, query_start, context_lens = [], [], [], [0], []
        logits_indices: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens + len(item.draft)
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tokens = seq.token_ids[start : start + item.num_tokens] + item.draft
            input_ids.append(np.asarray(tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(query_start[-1] + end - start)
            context_lens.append(end)
            if item.samples:  # a verify step needs logits at the last token and at every draft
                logits_indices.extend(range(query_start[-1] - 1 - len(item.draft), query_start[-1]))
        return ForwardBatch(
            input_ids=np.concatenate(input_ids),
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots),
            query_start_loc=np.asarray(query_start, dtype=np.int64),
            context_lens=np.asarray(context_lens, dtype=np.int64),
            block_tables=self._block_tables(scheduled),
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            state_slots=np.asarray([item.seq.state_slot for item in scheduled], dtype=np.int64),
        )

    def _prepare_decode(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        """prepare for a step of one token per sequence (decode), from Python ints: the general path's
        small NumPy operations per sequence cost more than the arithmetic (~12 us a decode step)."""
        bs, ids, pos, slots, rows = self.block_size, [], [], [], []
        for i, item in enumerate(scheduled):
            seq = item.seq
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 == seq.num_tokens:  # item.samples
                rows.append(i)
        positions = np.array(pos, dtype=np.int64)
        return ForwardBatch(
            input_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            slot_mapping=np.array(slots, dtype=np.int64),
            query_start_loc=np.arange(len(scheduled) + 1, dtype=np.int64),
            context_lens=positions + 1,
            block_tables=self._block_tables(scheduled),
            logits_indices=np.array(rows, dtype=np.int64),
            state_slots=np.array([item.seq.state_slot for item in scheduled], dtype=np.int64),
        )

    @staticmethod
    def _block_tables(scheduled: list[ScheduledSeq]) -> np.ndarray:
        width = max(len(item.seq.block_table) for item in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int64)
        for i, item in enumerate(scheduled):
            tables[i, : len(item.seq.block_table)] = item.seq.block_table
        return tables

    def run(self, scheduled: list[ScheduledSeq]) -> list[list[SampledToken]]:
        """One forward pass; per scheduled sequence the tokens it emits: none (a prefill chunk short of
        the prompt's end), one sampled token, or a verify step's accepted drafts and one more token."""
        batch = self.prepare(scheduled)
        masks = self._masks.start(scheduled)  # grammar masks beside the forward pass, if overlap is on
        out = self.model.forward(batch, self.kv_cache)
        if self.backend.samples_on_device and not any(item.draft for item in scheduled):
            masks.wait()
            return self._sample_on_device(scheduled, out)
        logits = self.backend.to_numpy(out)
        masks.wait()
        results: list[list[SampledToken]] = []
        row = 0
        for item in scheduled:
            if not item.samples:
                results.append([])
            elif item.draft:  # logits at its last token and at each draft
                rows = len(item.draft) + 1
                results.append(verify_draft(item.seq, item.draft, logits[row : row + rows], item.draft_probs))
                row += rows
            else:
                results.append([self._sample(item, logits[row])])
                row += 1
        return results

    def _sample_on_device(self, scheduled: list[ScheduledSeq], logits: Any) -> list[list[SampledToken]]:
        """The backend samples where the logits are (the same rules and draws as _sample)."""
        vocab = int(logits.shape[1])
        rows = [_sample_row(item.seq, vocab) for item in scheduled if item.samples]
        picked = iter(self.backend.sample(logits, rows))
        out: list[list[SampledToken]] = []
        for item in scheduled:
            p = next(picked) if item.samples else None
            out.append([SampledToken(p.token_id, p.logprob, p.top_logprobs)] if p is not None else [])
        return out

    def hidden_states(self, scheduled: list[ScheduledSeq], rows: np.ndarray) -> np.ndarray:
        """One forward pass without logits: the final normed hidden states (len(rows), dim) at `rows`
        of the step's tokens (embeddings pool them)."""
        batch = self.prepare(scheduled)
        batch.logits_indices = np.asarray(rows, dtype=np.int64)
        return self.backend.to_numpy(self.model.hidden_states(batch, self.kv_cache))

    @staticmethod
    def _sample(item: ScheduledSeq, logits: np.ndarray) -> SampledToken:
        seq, params = item.seq, item.seq.params
        if seq.forced:  # the engine closes a spent reasoning budget with the model's own end marker
            token_id = seq.forced[0]
        else:
            processed = logits  # (the token lists are copies of the whole sequence: only when used)
            if penalised(params):
                processed = apply_penalties(logits, params, seq.prompt_token_ids, seq.output_token_ids)
            if seq.held_stops and seq.num_output_tokens < params.min_tokens:
                processed = np.array(processed, dtype=np.float32, copy=True)
                processed[seq.held_stops] = -np.inf
            if seq.constraint is not None:
                processed = seq.constraint.mask_logits(processed)
            generator = token_generator(params.seed, seq.rng, seq.num_output_tokens)
            token_id = sample(processed, params, generator)
            if seq.constraint is not None:  # near the budget's end: a token the document cannot afford
                token_id = seq.constraint.steer(token_id)
        if params.logprobs is None:
            return SampledToken(token_id)
        lp = log_softmax(logits)  # the model's own distribution, before penalties and any grammar
        return SampledToken(token_id, float(lp[token_id]), top_logprobs(lp, params.logprobs))


def _sample_row(seq: Sequence, vocab: int) -> SampleRow:
    """A sequence's sampling as a backend samples it; a grammar's allowed tokens as a boolean mask."""
    allowed = None
    if seq.constraint is not None:
        allowed = np.isfinite(seq.constraint.mask_logits(np.zeros(vocab, dtype=np.float32)))
    return SampleRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.rng, allowed)
