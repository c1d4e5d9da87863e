"""Scheduler: decides which sequences run in the next step and how many tokens each contributes.

Every step spends a token budget (`max_num_batched_tokens`): running sequences first (a decode costs one
token, an unfinished prompt continues with a chunk), then waiting ones are admitted while blocks, the
budget and `max_num_seqs` allow. A long prompt is split into chunks, so it never freezes the other
streams. When blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed later. With speculative decoding, what the budget has left then goes to draft tokens: the
decoding sequences' draft slots (as many as `drafts.draft_lengths` asks, in plan order), their blocks
taken from free ones only. Pure bookkeeping: no arrays.

Fairness is by group (a client request's n choices share one): the next sequence admitted is the first
waiting one whose group runs the fewest sequences, and when every seat is taken, a group with none
running takes one from the group running the most (if that one runs two or more). So a request with
n=128 cannot hold another request's first token back by more than a step or two.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from localllm.engine.block_manager import BlockManager
from localllm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in the step
    # drafted tokens verified after them (speculative decoding): their K/V is written in the same pass,
    # and kept only as far as the drafts are accepted
    draft: list[int] = field(default_factory=list)
    draft_slots: int = 0  # draft tokens the scheduler budgeted and allocated blocks for (draft <= them)
    # the (len(draft), vocab) distributions a draft model sampled them from; None: one-hot drafts
    draft_probs: Any = None

    @property
    def samples(self) -> bool:
        """Whether the step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class DraftLengths(Protocol):
    """Speculative decoding's part in planning a step (engine/spec_decode.py's SpecDecoder)."""

    def draft_lengths(self, plan: SchedulerOutput) -> list[tuple[ScheduledSeq, int]]:
        """The draft tokens each of the plan's sequences would verify, before the budget and blocks."""
        ...


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        drafts: DraftLengths | None = None,
    ):  # fmt: skip
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.drafts = drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if self.drafts is not None and out.scheduled:
            self._schedule_drafts(out, self.drafts.draft_lengths(out))
        return out

    def _schedule_drafts(self, out: SchedulerOutput, wanted: list[tuple[ScheduledSeq, int]]) -> None:
        """Draft slots within what the plan's tokens left of the budget, in plan order; their blocks
        from free ones only: a draft, likely rejected, never preempts a sequence's real progress."""
        budget = self.max_num_batched_tokens - out.num_tokens
        for item, k in wanted:
            k = min(k, budget)
            if k > 0 and self.block_manager.allocate(item.seq, item.num_tokens + k):
                item.draft_slots = k
                budget -= k

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_tokens == 0 or not self._allocate_or_preempt(seq, num_tokens, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self._next_waiting()
            if len(self.running) >= self.max_num_seqs and not self._make_room(seq, out):
                break
            cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_tokens = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, num_tokens, cached):
                break
            self.waiting.remove(seq)
            self._admit(seq, num_cached)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens

    def _next_waiting(self) -> Sequence:
        """The first waiting sequence of a group running the fewest (first come first served among
        equals: min keeps the first of a tie)."""
        running = Counter(s.group for s in self.running)
        return min(self.waiting, key=lambda s: running[s.group])

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Every seat is taken: preempt the newest sequence of the group running the most, if `seq`'s
        group runs none and that group runs at least two (else `seq` waits for a seat)."""
        running = Counter(s.group for s in self.running)
        if running[seq.group]:
            return False
        group, count = max(running.items(), key=lambda item: item[1], default=(None, 0))
        if count < 2:
            return False
        victim = next(s for s in reversed(self.running) if s.group == group)
        self._preempt(victim, out)
        return True

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        if not seq.admitted:  # the first admission is what the user's cached-token count reports
            seq.num_cached_tokens = num_cached
            self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.admitted = True
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq wherever it is and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.block_table:
                self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
