"""Speculative decoding on the tiny random model: greedy output identical with and without it (prompt
lookup and draft models, alone and 16 at once), the acceptance rule keeps the target's distribution, and
rolled-back drafts leave the block manager as a plain run leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from engine_scenarios import alone, run_with_arrivals
from tiny_model import write_tiny_model

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.loaded_model import check_same_vocabulary, head_ids
from localllm.engine.ngram import propose_ngram
from localllm.engine.sequence import Sequence
from localllm.engine.spec_decode import MAX_CATCH_UP
from localllm.engine.spec_policy import (
    EXPLORE_EVERY,
    GATE_BACKOFF_FIRST,
    GATE_FRESH,
    GATE_MIN_STEPS,
    NEW_SEQ_PROBE,
    SpecPolicy,
    SpeedGate,
    StepCosts,
    best_length,
    expected_tokens,
    linear_costs,
)
from localllm.engine.spec_verify import verify_draft
from localllm.errors import ConfigError
from localllm.sampler import dense_distribution, make_generator
from localllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_engine(path, index_dir, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine(EngineConfig(model=str(path), backend="numpy", index_dir=index_dir, threads=1, **kw))


@pytest.fixture(scope="module")
def plain(tiny_model_path, index_dir):
    return make_engine(tiny_model_path, index_dir)


@pytest.fixture(scope="module")
def other_draft_path(tmp_path_factory):
    """A second random model with the same vocabulary: its drafts are mostly wrong."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-draft.Q8_0.gguf", seed=7, n_layers=1)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds matches to draft from."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 260, size=rng.integers(3, 9)).tolist()
        out.append(rng.integers(3, 260, size=rng.integers(1, 10)).tolist() + phrase * 3 + phrase[:2])
    return out


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert propose_ngram([7, 2, 3, 8, 1, 2, 3, 6, 5, 2, 3], 2) == [6, 5]  # the latest of two matches
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([1, 2, 1, 2], 0) == []


def test_policy_drafts_only_where_it_pays():
    assert expected_tokens(3, 0.0) == 1.0 and expected_tokens(3, 1.0) == 4.0
    assert best_length(0.9, linear_costs(0.05, 8)) == 8  # cheap and likely: draft the most
    assert best_length(0.2, linear_costs(0.5, 8)) == 0  # costly and unlikely: off
    assert 0 < best_length(0.8, linear_costs(0.3, 8)) < 8
    assert best_length(0.5, linear_costs(0.45, 8)) == 0  # a 3% gain at best: within noise, not worth a draft


def test_gate_stops_drafting_where_drafted_steps_are_slower_per_token():
    gate = SpeedGate()
    for _ in range(4):  # plain: 0.1 s a token at 8 decodes
        gate.record(8, 8, 0.8, drafted=False)
    for _ in range(GATE_MIN_STEPS):  # drafted: 12 tokens in 1.5 s, 0.125 s a token
        assert gate.is_open(8)
        gate.record(8, 12, 1.5, drafted=True)
    assert [gate.is_open(8) for _ in range(GATE_BACKOFF_FIRST + 1)] == [False] * GATE_BACKOFF_FIRST + [True]
    assert gate.is_open(1)  # batch widths are judged apart
    for _ in range(6):  # where drafting is faster, the gate stays open
        gate.record(1, 3, 0.2, drafted=True)
        gate.record(1, 1, 0.1, drafted=False)
        assert gate.is_open(1)
    for _ in range(GATE_FRESH):  # a long run of drafted steps: then one plain step, for a fresh comparison
        assert gate.is_open(1)
        gate.record(1, 3, 0.2, drafted=True)
    assert not gate.is_open(1)


def test_gate_judges_seconds_per_token_as_a_ratio_of_sums():
    """Verify steps emit 1 to k+1 tokens: 0.15 s for 6 tokens is 0.025 s a token, a clear win over plain
    0.03, though the mean of the steps' own ratios (0.05, 0.025, 0.017) reads 0.031, a loss."""
    gate = SpeedGate()
    for _ in range(3):
        gate.record(1, 1, 0.03, drafted=False)
    for _ in range(GATE_MIN_STEPS):  # judged every GATE_MIN_STEPS drafted steps: three times
        for emitted in (1, 2, 3):
            assert gate.is_open(1)
            gate.record(1, emitted, 0.05, drafted=True)
        gate.record(1, 1, 0.03, drafted=False)


def test_step_costs_interpolate_and_shrug_off_a_slow_step():
    costs = StepCosts()
    for rows, ms in ((1, 10.0), (3, 11.0), (9, 30.0)):
        for _ in range(2):  # the first of a size is skipped (kernels may load)
            costs.record(rows, ms / 1000)
    assert costs.step_time(2) == pytest.approx(0.0105)
    assert costs.step_time(5) == pytest.approx(0.011 + 2 * 0.019 / 6)
    assert costs.step_time(12) == pytest.approx(0.030 + 3 * 0.019 / 6)  # the last slope, extended
    for ms in (20.0, 11.0, 11.0):  # one step delayed 2x (a thread-count probe, another tenant)
        costs.record(3, ms / 1000)
    assert costs.step_time(3) == pytest.approx(0.011)


def test_a_long_catch_up_is_not_a_drafting_cost():
    """A sequence that drafts again after plain steps first catches its draft up on them: a one-off,
    which as a per-token cost (0.2 s here against 0.01) turned speculation off for every sequence."""
    policy = SpecPolicy(8, cheap_probes=False)
    for steady, draft_seconds in ((True, 0.02), (True, 0.02), (False, 0.4), (True, 0.02)):
        policy.record_step(1, 3, 3, draft_seconds + 0.03, draft_seconds, steady)
    assert policy.costs.draft_per_token == pytest.approx(0.01)
    assert policy.gate.rates[1].drafted_seconds == pytest.approx(0.05 * (1 + 0.9 + 0.81))


def test_no_draft_prefill_where_the_gate_has_closed_drafting():
    policy = SpecPolicy(8, cheap_probes=False)
    policy.gate.rates[8] = SimpleNamespace(closed_for=5)
    assert policy.drafts("a", 1) and not policy.drafts("b", 8)


def test_a_draft_that_would_catch_up_on_a_whole_prompt_does_not_start(
    plain, tiny_model_path, other_draft_path, index_dir
):
    """A sequence the draft did not prefill with the target (it started off) would first catch up on its
    whole prompt: past MAX_CATCH_UP tokens it does not draft; a short one does."""
    spec = make_engine(tiny_model_path, index_dir, draft_model=str(other_draft_path))
    spec.spec.policy.drafts = lambda request_id, num_decodes: False
    spec.spec.policy.lengths = lambda ids, num_tokens: [2] * len(ids)
    long_prompt = list(range(3, 3 + MAX_CATCH_UP + 10))
    assert alone(spec, long_prompt, GREEDY) == alone(plain, long_prompt, GREEDY)
    assert spec.spec.stats.drafted_tokens == 0
    assert alone(spec, long_prompt[:20], GREEDY) == alone(plain, long_prompt[:20], GREEDY)
    assert spec.spec.stats.drafted_tokens > 0


def test_new_sequences_start_from_what_the_ones_before_saw():
    policy = SpecPolicy(8, cheap_probes=False)
    policy.cost = linear_costs(0.3, 8)
    assert policy.drafts("a", 1)  # nothing seen yet: hopeful
    for _ in range(10):
        policy.record_verify("a", 4, 0)
    assert policy.lengths(["a"], 1) == [0]
    for _ in range(3 * EXPLORE_EVERY):  # a draft model's off sequence does not probe (catch-up costs)
        assert policy.lengths(["a"], 1) == [0]
    starts = [policy.drafts(f"new-{i}", 1) for i in range(2 * NEW_SEQ_PROBE)]
    assert starts.count(True) == 2  # all start off, but every NEW_SEQ_PROBE-th


@pytest.mark.parametrize("how", ["lookup", "self-draft", "other-draft"])
def test_greedy_identical_alone_and_in_a_batch_of_16(
    how, plain, tiny_model_path, other_draft_path, index_dir
):
    options = {
        "lookup": {"prompt_lookup": True},
        "self-draft": {"draft_model": str(tiny_model_path)},
        "other-draft": {"draft_model": str(other_draft_path)},
    }[how]
    spec = make_engine(tiny_model_path, index_dir, **options)
    spec.spec.policy.lengths = lambda ids, num_tokens: [8] * len(ids)  # the longest drafts, every step
    ps = prompts(16, seed=1)
    expected = {i: alone(plain, p, GREEDY) for i, p in enumerate(ps)}
    assert {i: alone(spec, p, GREEDY) for i, p in enumerate(ps[:4])} == {i: expected[i] for i in range(4)}
    assert run_with_arrivals(spec, ps, GREEDY, seed=2) == expected
    stats = spec.spec.stats
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    if how == "self-draft":  # a model drafting for itself is always right
        assert stats.accepted_tokens == stats.drafted_tokens
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
    if how != "lookup":
        draft_blocks = spec.spec.proposer.block_manager
        spec.step()  # the next step forgets the finished sequences' shadows
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks


@pytest.mark.parametrize("how", ["lookup", "other-draft"])
def test_rollback_keeps_blocks_and_prefix_hashes_consistent(
    how, tiny_model_path, other_draft_path, index_dir
):
    """A tight pool (preemptions) with speculation: same output, every block back, and every block in the
    prefix cache holds tokens the sequences really have (never a rejected draft)."""
    ps = prompts(10, seed=3)
    spec = {"prompt_lookup": True} if how == "lookup" else {"draft_model": str(other_draft_path)}
    engines = [
        make_engine(tiny_model_path, index_dir, num_kv_blocks=10, ctx_size=128, max_num_seqs=8, **kw)
        for kw in ({}, spec)
    ]
    outs = [run_with_arrivals(e, ps, GREEDY, seed=4) for e in engines]
    assert outs[0] == outs[1]
    bm, stats = engines[1].block_manager, engines[1].spec.stats
    assert bm.num_free_blocks == bm.num_blocks and stats.drafted_tokens > 0
    if how == "other-draft":
        assert stats.accepted_tokens < stats.drafted_tokens  # some drafts were rolled back
    pools = [bm] if how == "lookup" else [bm, engines[1].spec.proposer.block_manager]
    for pool in pools:  # the draft's own prefix cache too: never a block holding a draft
        valid = valid_hashes([p + outs[1][i] for i, p in enumerate(ps)], bm.block_size, pool.fingerprint)
        assert pool.hash_to_block_id and set(pool.hash_to_block_id) <= valid
        assert all(pool.blocks[b].hash == h for h, b in pool.hash_to_block_id.items())


def test_draft_pool_prefix_cache_serves_a_repeated_prompt(tiny_model_path, other_draft_path, index_dir):
    engine = make_engine(tiny_model_path, index_dir, draft_model=str(other_draft_path))
    engine.spec.policy.lengths = lambda ids, num_tokens: [2] * len(ids)
    prompt = prompts(1, seed=5)[0] * 3
    first = alone(engine, prompt, GREEDY)
    draft = engine.spec.proposer
    shadow = draft._new_shadow(Sequence("again", prompt, GREEDY))
    block = draft.block_manager.block_size
    assert shadow.num_computed_tokens == (len(prompt) - 1) // block * block > 0
    draft.block_manager.free(shadow)
    assert alone(engine, prompt, GREEDY) == first


def valid_hashes(sequences: list[list[int]], block_size: int, root: bytes) -> set[bytes]:
    """The chained key of every full block of every sequence, from the model fingerprint `root`."""
    from localllm.engine.block_manager import block_hash

    valid = set()
    for tokens in sequences:
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = block_hash(parent, tuple(tokens[start : start + block_size]), root)
            valid.add(parent)
    return valid


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model_path, index_dir):
    params = SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=20, ignore_eos=True)
    spec = make_engine(tiny_model_path, index_dir, prompt_lookup=True)
    p = prompts(1, seed=6)[0]
    assert alone(spec, p, params) == alone(spec, p, params)


@pytest.mark.parametrize("how", ["lookup", "other-draft"])
def test_seeded_sampling_gives_plain_output_whatever_the_draft_lengths(
    how, plain, tiny_model_path, other_draft_path, index_dir
):
    """Draft lengths follow measured step times, so they differ from run to run: a seed's output must not
    depend on them (it did: the accept/reject draws shifted the request's one random stream)."""
    params = SamplingParams(temperature=0.5, top_k=20, seed=5, max_tokens=30, ignore_eos=True)
    spec_kw = {"prompt_lookup": True} if how == "lookup" else {"draft_model": str(other_draft_path)}
    p = prompts(1, seed=3)[0]  # at this temperature its lookups draft, and some drafts are kept
    want = alone(plain, p, params)
    for k in (1, 3, 8):
        spec = make_engine(tiny_model_path, index_dir, **spec_kw)
        spec.spec.policy.lengths = lambda ids, num_tokens, k=k: [k] * len(ids)
        assert alone(spec, p, params) == want, k
        assert spec.spec.stats.drafted_tokens > 0 and spec.spec.stats.verify_steps > 1


def test_draft_head_scores_the_first_ids_and_every_special_one():
    tok = SimpleNamespace(is_special=lambda i: i in (0, 7), is_eog=lambda i: i == 9)
    assert head_ids(tok, 10, 4).tolist() == [0, 1, 2, 3, 7, 9]
    assert head_ids(tok, 10, 0) is None and head_ids(tok, 10, 10) is None


def test_restricted_draft_head_drafts_only_its_ids_and_keeps_greedy_output(plain, tiny_model_path, index_dir):
    """A model drafting for itself with a 100-id head: its drafts are its own argmax among those ids,
    kept whenever the target's token is one of them; the output is plain decoding's."""
    spec = make_engine(tiny_model_path, index_dir, draft_model=str(tiny_model_path), draft_vocab=100)
    spec.spec.policy.lengths = lambda ids, num_tokens: [3] * len(ids)
    proposer, drafted = spec.spec.proposer, []
    propose = proposer.propose
    proposer.propose = lambda requests: [(drafted.extend(d) or d, q) for d, q in propose(requests)]
    ps = prompts(4, seed=8)
    assert [alone(spec, p, GREEDY) for p in ps] == [alone(plain, p, GREEDY) for p in ps]
    stats = spec.spec.stats
    assert drafted and max(drafted) < 100 and 0 < stats.accepted_tokens < stats.drafted_tokens


def test_draft_model_with_another_vocabulary_is_refused():
    target = SimpleNamespace(metadata={"tokenizer.ggml.tokens": ["a", "b", "c"]}, path=_Named("big.gguf"))
    draft = SimpleNamespace(metadata={"tokenizer.ggml.tokens": ["a", "x", "c"]}, path=_Named("small.gguf"))
    with pytest.raises(ConfigError, match="does not share big.gguf's vocabulary.*token 1"):
        check_same_vocabulary(target, draft)
    check_same_vocabulary(target, target)


class _Named:
    def __init__(self, name: str):
        self.name = name


# ---- the acceptance rule keeps the target's distribution ------------------------------------------------

VOCAB = 6
TARGET = np.log(np.array([0.05, 0.4, 0.2, 0.15, 0.1, 0.1]))
DRAFT_Q = np.array([0.3, 0.1, 0.1, 0.3, 0.1, 0.1])


def _first_tokens(params: SamplingParams, q: np.ndarray | None, trials: int = 20000) -> np.ndarray:
    """The distribution of the first token a one-draft verify step emits."""
    rng = np.random.default_rng(0)
    seq = Sequence("s", [0], params, make_generator(1))
    logits = np.stack([TARGET, TARGET]).astype(np.float32)
    counts = np.zeros(VOCAB)
    for _ in range(trials):
        draft = int(rng.choice(VOCAB, p=q)) if q is not None else 3
        counts[verify_draft(seq, [draft], logits, None if q is None else q[None, :])[0].token_id] += 1
    return counts / trials


@pytest.mark.parametrize("q", [DRAFT_Q, None], ids=["draft-model", "lookup"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, repeat_penalty=1.3),  # penalty on token 0 (the prompt)
])  # fmt: skip
def test_rejection_sampling_keeps_the_target_distribution(q, params):
    from localllm.sampler import apply_penalties

    p = dense_distribution(apply_penalties(TARGET.astype(np.float32), params, [0], []), params)
    freq = _first_tokens(params, q)
    sigma = np.sqrt(p * (1 - p) / 20000)
    assert np.all(np.abs(freq - p) <= 4.5 * sigma + 1e-9), (freq, p)


def test_greedy_verify_keeps_the_argmax_prefix():
    seq = Sequence("s", [0], SamplingParams(temperature=0), None)
    logits = np.eye(VOCAB, dtype=np.float32)[[2, 4, 1, 5]]  # argmax 2, 4, 1, 5
    assert [t.token_id for t in verify_draft(seq, [2, 4, 3], logits)] == [2, 4, 1]
    assert [t.token_id for t in verify_draft(seq, [2, 4, 1], logits)] == [2, 4, 1, 5]
    assert [t.token_id for t in verify_draft(seq, [0, 4, 1], logits)] == [2]


# ---- the front ends ---------------------------------------------------------------------------------------


def test_metrics_report_drafted_and_accepted(tiny_model_path, index_dir, monkeypatch):
    from localllm.server.metrics import ServerMetrics

    engine = make_engine(tiny_model_path, index_dir, prompt_lookup=True)
    engine.generate(prompts(2, seed=8), GREEDY)
    stats = engine.spec.stats
    text = ServerMetrics(engine.stats).render()[0].decode()
    LABEL = '{model_name="default"}'  # every sample carries the served model's name
    assert f"localllm:spec_decode_num_draft_tokens_total{LABEL} {float(stats.drafted_tokens)}" in text
    assert f"localllm:spec_decode_num_accepted_tokens_total{LABEL} {float(stats.accepted_tokens)}" in text
    assert f"localllm:spec_decode_draft_acceptance_rate{LABEL} {stats.acceptance_rate}" in text
    import httpx

    from localllm.bench import serving

    monkeypatch.setattr(httpx, "get", lambda *args, **kw: SimpleNamespace(text=text))
    counts = serving.spec_counts("http://server", {})  # what bench serve reads back
    assert counts["drafted_tokens"] == stats.drafted_tokens
    assert counts["accepted_tokens"] == stats.accepted_tokens
    assert counts["acceptance_rate"] == pytest.approx(stats.acceptance_rate)


def _cli(tmp_path, *args: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, LOCALLLM_HOME=str(tmp_path / "home"))
    cmd = [sys.executable, "-m", "localllm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_run_json_reports_the_counts_and_refuses_two_ways_to_draft(tiny_model_path, tmp_path):
    import json

    base = ["run", str(tiny_model_path), "abc abc abc abc", "--raw", "--backend", "numpy", "-n", "12"]
    result = _cli(tmp_path, *base, "--temperature", "0", "--prompt-lookup", "--json")
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["speculative"]
    assert spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0 and 0 <= spec["acceptance_rate"] <= 1
    both = _cli(tmp_path, *base, "--prompt-lookup", "--draft-model", str(tiny_model_path))
    assert both.returncode == 1 and both.stderr.strip() == (
        "error: choose one way to draft: --prompt-lookup or --draft-model, not both"
    )


def test_bench_spec_compares_off_and_on(tiny_model_path, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from localllm.cli import bench  # noqa: F401  (registers the bench group and its modes)
    from localllm.cli.app import app

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "spec.json"
    model = str(tiny_model_path)
    args = ["bench", "spec", model, "--draft-model", model, "--backend", "numpy", "--workload", "creative"]
    args += ["--temperature", "0", "-n", "6", "-r", "1", "--prompts", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    assert data["workload"] == "creative" and len(data["on_tokens_per_s"]["samples"]) == 1
    # its own draft is always right (though the policy soon finds that drafting with itself never pays)
    assert data["accepted_tokens"] == data["drafted_tokens"]
    assert data["off_tokens_per_s"]["mean"] > 0 and data["on_tokens_per_s"]["mean"] > 0
    on, off = data["on_tokens_per_s"]["samples"][0], data["off_tokens_per_s"]["samples"][0]
    assert data["paired_speedup"] == pytest.approx(on / off)
