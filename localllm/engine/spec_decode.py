"""Speculative decoding inside continuous batching: the engine's glue.

Each step, once the scheduler has planned the plain tokens, it asks `draft_lengths` how many drafts each
decoding sequence would verify (as many as spec_policy says pays) and reserves draft slots for them
within the step's token budget, growing their block tables from free blocks (drafts never preempt
anything). `propose` fills the slots with drafted tokens (prompt lookup or a draft model). The target
then runs ONE forward pass over the whole ragged batch (a sequence with k drafts is a (k+1)-token query
with logits at every position), and its sampling applies the acceptance rule per sequence (spec_verify).
The engine emits every kept token through its one per-token path and rolls the rest back
(num_computed_tokens, surplus blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localllm.config import EngineConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.loaded_model import LoadedModel
from localllm.engine.ngram import propose_ngram
from localllm.engine.output import SampledToken
from localllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from localllm.engine.sequence import Sequence
from localllm.engine.spec_policy import SpecPolicy

if TYPE_CHECKING:
    from localllm.backends.threads import ThreadGovernor

# A draft model's shadow that catches up on more tokens than this before drafting (a sequence drafting
# again after plain steps) is not a steady-state sample of the drafting cost: the policy skips it.
STEADY_CATCH_UP = 8
# A draft model's shadow that lags more than this does not start drafting: catching up on a whole prompt
# costs as much as its prefill (0.7 s for 400 tokens of the 0.5B), more than drafting wins back on a
# short reply. Sequences the draft prefilled with the target, or that stopped drafting for a few steps,
# are within it.
MAX_CATCH_UP = 64


@dataclass(slots=True)
class SpecStats:
    drafted_tokens: int = 0  # drafted tokens verified by the target
    accepted_tokens: int = 0  # of which kept
    verify_steps: int = 0  # sequence-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "verify_steps": self.verify_steps,
        }

    def summary(self) -> str:
        return (
            f"drafted: {self.drafted_tokens}, accepted: {self.accepted_tokens} "
            f"({100 * self.acceptance_rate:.0f}%)"
        )


class NgramProposer:
    """Prompt lookup: no model, no state, next to no cost."""

    def prefill(self, scheduled: list[ScheduledSeq]) -> None:
        pass

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[tuple[list[int], Any]]:
        return [(propose_ngram(seq.token_ids, k), None) for seq, k in requests]

    def lag(self, seq: Sequence) -> int:
        return 0

    def release(self, request_id: str) -> None:
        pass


def open_spec_decoder(config: EngineConfig, target: LoadedModel) -> SpecDecoder:
    """The speculation config asks for, on the target's model: prompt lookup, or config.draft_model
    opened beside it on the same backend."""
    if config.draft_model:
        from localllm.engine.draft_model import DraftModel

        draft = LoadedModel.open(config.draft_model, target.backend, config, target=target)
        proposer: Any = DraftModel(draft, target.args.vocab_size)
    else:
        proposer = NgramProposer()
    governor = target.backend.thread_governor(target.model)
    return SpecDecoder(proposer, target.block_manager, governor, target.max_model_len, config)


class SpecDecoder:
    def __init__(
        self, proposer: Any, block_manager: BlockManager, governor: ThreadGovernor | None,
        max_model_len: int, config: EngineConfig,
    ):  # fmt: skip
        """proposer: NgramProposer or DraftModel; block_manager: the target's, whose blocks the drafts
        take; governor: the target's thread governor, if its backend has one; max_model_len: the
        target's context, which drafts never pass."""
        self.proposer = proposer
        self.block_manager = block_manager
        self.governor = governor
        self.max_model_len = max_model_len
        self.policy = SpecPolicy(config.draft_max, cheap_probes=not config.draft_model)
        self.stats = SpecStats()
        self.enabled = True  # off: plain steps (bench compares both on one engine)
        self._draft_seconds = 0.0  # this step's drafting, catching up included
        self._drafted = 0
        self._accepted = 0  # this step's kept drafts
        self._lag = 0  # the most tokens a drafting sequence's draft caught up on this step
        self._prefills: list[ScheduledSeq] = []  # this step's prefill chunks the draft keeps up with

    def draft_lengths(self, plan: SchedulerOutput) -> list[tuple[ScheduledSeq, int]]:
        """The scheduler's question, once the step's plain tokens are planned: how many drafts each
        decoding sequence would verify, as the policy says pays, capped by the context and max_tokens;
        none where the draft model lags far. The scheduler fits them into the step's token budget and
        free blocks. Also notes which prefill chunks the draft model keeps up with (propose runs it)."""
        self._drafted = self._accepted = self._lag = 0
        self._prefills = []
        if not self.enabled:
            return []
        width = sum(1 for it in plan.scheduled if it.samples)  # sequences decoding from the next step
        self._prefills = [
            it
            for it in plan.scheduled
            if (it.num_tokens > 1 or not it.samples) and self.policy.drafts(it.seq.request_id, width)
        ]
        decodes = [it for it in plan.scheduled if it.samples and it.num_tokens == 1 and _eligible(it.seq)]
        if not decodes:
            return []
        lengths = self.policy.lengths([it.seq.request_id for it in decodes], plan.num_tokens)
        return [(item, self._cap(item.seq, k)) for item, k in zip(decodes, lengths, strict=True)]

    def _cap(self, seq: Sequence, k: int) -> int:
        """k drafts for seq, within the context and max_tokens; none when its draft lags far."""
        left = seq.params.max_tokens - seq.num_output_tokens if seq.params.max_tokens else k + 1
        k = min(k, self.max_model_len - seq.num_tokens - 1, left - 1)
        return k if self.proposer.lag(seq) <= MAX_CATCH_UP else 0

    def propose(self, plan: SchedulerOutput) -> None:
        """Fill the draft slots the scheduler made room for (the draft model first keeps up with the
        step's prefill chunks); a sequence whose proposer found nothing gives its slots' blocks back."""
        start = time.perf_counter()
        if self._prefills:
            self.proposer.prefill(self._prefills)
            self._prefills = []
        wanted = [it for it in plan.scheduled if it.draft_slots]
        if wanted:
            self._lag = max(self.proposer.lag(it.seq) for it in wanted)
            proposals = self.proposer.propose([(it.seq, it.draft_slots) for it in wanted])
            for item, (draft, probs) in zip(wanted, proposals, strict=True):
                item.draft, item.draft_probs = draft, probs
                self._drafted += len(draft)
                if not draft:  # nothing found: give back the blocks taken for it
                    self.block_manager.trim(item.seq, item.seq.num_tokens)
        self._draft_seconds = time.perf_counter() - start

    def record_verified(self, scheduled: list[ScheduledSeq], sampled: list[list[SampledToken]]) -> None:
        """Count what the step's sampling kept of each sequence's drafts: all its tokens but the last."""
        for item, tokens in zip(scheduled, sampled, strict=True):
            if not item.draft:
                continue
            accepted = len(tokens) - 1
            self.stats.drafted_tokens += len(item.draft)
            self.stats.accepted_tokens += accepted
            self.stats.verify_steps += 1
            self._accepted += accepted
            self.policy.record_verify(item.seq.request_id, len(item.draft), accepted)

    def record_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """Feed a decode/verify step's measured time, drafting included, to the policy (steps with
        prefill are left out: they would swamp it)."""
        decode_only = all(it.num_tokens == 1 and it.samples for it in plan.scheduled)
        # a thread-count probe (one thread can take 2x) is not what this step size costs
        if self.enabled and decode_only and not self._probe_step(plan.num_tokens + self._drafted):
            n = len(plan.scheduled)
            emitted = n + self._accepted
            steady = self._lag <= STEADY_CATCH_UP
            self.policy.record_step(n, n + self._drafted, emitted, seconds, self._draft_seconds, steady)
        self._draft_seconds, self._drafted, self._accepted, self._lag = 0.0, 0, 0, 0

    def _probe_step(self, num_tokens: int) -> bool:
        """Whether the target's forward pass ran with a thread count its governor is only re-measuring
        (backends with a governor)."""
        return self.governor is not None and self.governor.ran_probe(num_tokens)

    def release(self, request_id: str) -> None:
        """A finished or aborted request: drop its draft state (and the draft model's blocks)."""
        self.proposer.release(request_id)
        self.policy.forget(request_id)


def _eligible(seq: Sequence) -> bool:
    """Whether seq may draft: not a constrained one (its grammar masks one token per step), nor one
    whose next tokens are forced (a spent reasoning budget), nor one still short of its min_tokens."""
    if seq.held_stops and seq.num_output_tokens < seq.params.min_tokens:
        return False  # its stop tokens are masked until min_tokens: drafts are not verified that way
    return seq.constraint is None and not seq.forced
