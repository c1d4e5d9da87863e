"""Property tests of the block manager and scheduler: random arrivals, lengths, aborts and pool sizes.

Every request finishes or is rejected with a reason, no block is leaked or double-owned, and the pool
is whole again when all is done. No model: tokens are made up, which is all the bookkeeping sees.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.block_manager import BlockManager
from localllm.engine.scheduler import Scheduler
from localllm.engine.sequence import Sequence, SequenceStatus
from localllm.sampling_params import SamplingParams


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    owners = Counter(b for seq in sched.running for b in seq.block_table)
    for seq in sched.waiting:
        assert not seq.block_table, "a waiting sequence holds blocks"
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids)
    for seq in sched.running:
        assert len(seq.block_table) == len(set(seq.block_table)), "a block twice in one table"
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
    assert len(sched.running) <= sched.max_num_seqs


def simulate(requests, num_blocks, block_size, max_num_seqs, budget, prefix_caching, abort_rate, seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(bm, max_num_seqs, budget)
    max_model_len = num_blocks * block_size
    pending = list(enumerate(requests))
    seqs, outcome, step = {}, {}, 0
    while pending or sched.has_unfinished():
        step += 1
        assert step < 20_000, "no progress: the scheduler deadlocked"
        while pending and pending[0][1][0] <= step:  # arrivals
            i, (_, prompt, max_tokens) = pending.pop(0)
            if len(prompt) >= max_model_len:
                outcome[i] = "rejected"
                continue
            seqs[i] = Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens))
            sched.add(seqs[i])
        for i, seq in seqs.items():  # random aborts
            if not seq.is_finished and rng.random() < abort_rate:
                sched.finish(seq, "abort")
                outcome[i] = "abort"
        plan = sched.schedule()
        for item in plan.scheduled:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_tokens
            bm.cache_full_blocks(seq)
            if samples:
                seq.append_token(rng.randrange(4))
                if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
                    sched.finish(seq, "length")
                    outcome[int(seq.request_id)] = "length"
        check_invariants(bm, sched)
    return bm, sched, outcome, seqs


request = st.tuples(
    st.integers(1, 30),  # arrival step
    st.lists(st.integers(0, 3), min_size=1, max_size=120),  # prompt: tiny alphabet, so prefixes repeat
    st.integers(1, 40),  # max tokens
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request, min_size=1, max_size=24).map(lambda r: sorted(r, key=lambda x: x[0])),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
    prefix_caching=st.booleans(),
    abort_rate=st.sampled_from([0.0, 0.01, 0.05]),
    seed=st.integers(0, 1000),
)
def test_every_request_ends_and_the_pool_is_whole(
    requests, num_blocks, block_size, max_num_seqs, budget, prefix_caching, abort_rate, seed
):
    bm, sched, outcome, seqs = simulate(
        requests, num_blocks, block_size, max_num_seqs, budget, prefix_caching, abort_rate, seed
    )
    assert len(outcome) == len(requests), "a request neither finished nor was rejected"
    assert all(seq.status == SequenceStatus.FINISHED for seq in seqs.values())
    assert bm.num_free_blocks == num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_cache_hit_reports_cached_tokens():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 4, 64)
    first = Sequence("a", list(range(10)), SamplingParams(max_tokens=1))
    sched.add(first)
    plan = sched.schedule()
    first.num_computed_tokens += plan.scheduled[0].num_tokens
    bm.cache_full_blocks(first)
    sched.finish(first, "length")
    second = Sequence("b", list(range(9)) + [99, 100], SamplingParams(max_tokens=1))
    sched.add(second)
    plan = sched.schedule()
    assert second.num_cached_tokens == 8  # two full blocks of 4 shared
    assert plan.scheduled[0].num_tokens == 3


def test_hash_collision_is_verified_by_tokens():
    bm = BlockManager(8, 2)
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    assert bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    bm.cache_full_blocks(seq)
    block = bm.blocks[seq.block_table[0]]
    block.token_ids = (7, 7)  # simulate a colliding hash holding other tokens
    assert bm.find_cached_prefix(Sequence("b", [1, 2, 3], SamplingParams())) == []


def test_chunked_prefill_shares_the_step_with_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 4, 8)
    short = Sequence("short", [1, 2], SamplingParams(max_tokens=50))
    sched.add(short)
    plan = sched.schedule()
    short.num_computed_tokens += 2
    short.append_token(5)
    sched.add(Sequence("long", list(range(40)), SamplingParams()))
    plan = sched.schedule()
    sizes = {item.seq.request_id: item.num_tokens for item in plan.scheduled}
    assert sizes == {"short": 1, "long": 7}  # the decode goes first, the prompt gets a chunk


def test_preemption_frees_the_newest_sequence():
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, 4, 64)
    a, b = Sequence("a", [1, 2, 3, 4], SamplingParams()), Sequence("b", [5, 6, 7, 8], SamplingParams())
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and bm.num_free_blocks == 0
    for item in plan.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        item.seq.append_token(0)  # 5 tokens each now: the next step needs a third block
    plan = sched.schedule()
    assert [s.request_id for s in plan.preempted] == ["b"]
    assert [s.seq.request_id for s in plan.scheduled] == ["a"]
    assert b.num_computed_tokens == 0 and not b.block_table and sched.waiting[0] is b


def _step(sched: Scheduler) -> list[Sequence]:
    """One scheduler step with a made-up token for every sequence that samples; the scheduled ones."""
    out = sched.schedule()
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        if samples:
            item.seq.append_token(1)
    return [item.seq for item in out.scheduled]


def test_a_request_with_many_choices_cannot_hold_another_back() -> None:
    """128 choices of one request fill every seat; a one-choice request arriving later runs at the next
    step (a seat taken from the big group, which is recomputed later), and the big group keeps the rest."""
    bm = BlockManager(4096, 16, True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    many = [Sequence(f"n-{i}", [5] * 20, SamplingParams(max_tokens=64), group="n") for i in range(128)]
    for seq in many:
        sched.add(seq)
    for _ in range(3):
        assert len(_step(sched)) == 8
    late = Sequence("late", [6] * 20, SamplingParams(max_tokens=16))
    sched.add(late)
    scheduled = _step(sched)
    assert late in scheduled and late.status == SequenceStatus.RUNNING
    assert Counter(s.group for s in sched.running) == {"n": 7, "late": 1}
    check_invariants(bm, sched)


def test_fair_admission_prefers_groups_running_the_fewest() -> None:
    bm = BlockManager(4096, 16, True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=512)
    for i in range(6):
        sched.add(Sequence(f"a-{i}", [5] * 8, SamplingParams(), group="a"))
    for i in range(2):
        sched.add(Sequence(f"b-{i}", [6] * 8, SamplingParams(), group="b"))
    _step(sched)
    assert Counter(s.group for s in sched.running) == {"a": 2, "b": 2}  # not a-0..a-3 first come
    check_invariants(bm, sched)


class _AskFor:
    """A stand-in for the spec decoder: asks for k drafts for every decoding sequence of a plan."""

    def __init__(self, k: int):
        self.k = k
        self.plans = 0

    def draft_lengths(self, plan):
        self.plans += 1
        return [(item, self.k) for item in plan.scheduled if item.samples and item.num_tokens == 1]


def _decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Prefill seqs and give each its first token: the next plan decodes them."""
    for seq in seqs:
        sched.add(seq)
    for item in sched.schedule().scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        item.seq.append_token(0)


def test_draft_tokens_share_the_step_budget_in_plan_order():
    bm = BlockManager(64, 4)
    drafts = _AskFor(3)
    sched = Scheduler(bm, 4, 64, drafts)
    a, b, c = (Sequence(n, [1, 2, 3], SamplingParams()) for n in "abc")
    _decoding(sched, a, b, c)
    sched.max_num_batched_tokens = 7
    plan = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens, i.draft_slots) for i in plan.scheduled] == [
        ("a", 1, 3),
        ("b", 1, 1),  # 7 tokens: three decodes, then 3 + 1 drafts
        ("c", 1, 0),
    ]
    assert [len(s.block_table) for s in (a, b, c)] == [2, 2, 1]  # 4 + 3 tokens; 4 + 1; 4
    assert drafts.plans == 2


def test_drafts_take_free_blocks_only_and_never_preempt():
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, 4, 64, _AskFor(8))
    a, b = Sequence("a", [1, 2, 3], SamplingParams()), Sequence("b", [4, 5, 6], SamplingParams())
    _decoding(sched, a, b)
    plan = sched.schedule()  # a's 8 drafts would need 3 blocks, 2 more than the 1 free: no slots
    assert [(i.seq.request_id, i.draft_slots) for i in plan.scheduled] == [("a", 0), ("b", 0)]
    assert not plan.preempted and bm.num_free_blocks == 1


def test_each_step_hashes_only_the_blocks_filled_since_the_last(monkeypatch):
    """cache_full_blocks runs every step: it hashes the newly full blocks, not the whole context again;
    after a preemption (blocks freed) it starts over."""
    from localllm.engine import block_manager

    hashed = []
    real = block_manager.block_hash
    monkeypatch.setattr(block_manager, "block_hash", lambda *a: hashed.append(a[1]) or real(*a))
    bm = BlockManager(64, 4, True)
    seq = Sequence("a", list(range(10)), SamplingParams())
    assert bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    bm.cache_full_blocks(seq)
    assert hashed == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for t in range(10, 40):  # decode: a token a step
        seq.token_ids.append(t)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert hashed == [tuple(range(i, i + 4)) for i in range(0, 40, 4)]
    table = list(seq.block_table)
    bm.free(seq)  # preempted: the scheduler recomputes it from its cached prefix
    seq.num_computed_tokens = 0
    found = bm.find_cached_prefix(seq)
    assert found == table[:9] and bm.allocate(seq, 4, found)  # the last block is left to compute
    hashed.clear()  # (the lookup hashed the prompt's blocks)
    seq.num_computed_tokens = 40
    bm.cache_full_blocks(seq)
    assert hashed == [(36, 37, 38, 39)] and seq.num_hashed_blocks == 10
