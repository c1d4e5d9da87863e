"""The engine on the tiny random model: batching, prefix caching and preemption never change greedy output."""

from __future__ import annotations

import numpy as np
import pytest
from engine_scenarios import alone, run_with_arrivals

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, check_context_length, score_tokens
from localllm.errors import ContextLengthExceededError, LocalLLMError
from localllm.sampling_params import BUILTIN_DEFAULTS, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(path, index_dir, backend="numpy", **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model=str(path), backend=backend, index_dir=index_dir, threads=1, **kw))


@pytest.fixture(scope="module")
def engine(tiny_model_path, index_dir):
    return make_engine(tiny_model_path, index_dir)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, size=20).tolist()
    return [
        shared[: rng.integers(1, 20)] + rng.integers(3, 250, size=rng.integers(1, 40)).tolist()
        for _ in range(n)
    ]


def test_batched_equals_alone(engine):
    ps = prompts(10)
    expected = {i: alone(engine, p, GREEDY) for i, p in enumerate(ps)}
    assert run_with_arrivals(engine, ps, GREEDY, seed=1) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_on_off_and_preemption_agree(tiny_model_path, index_dir, engine):
    ps = prompts(10, seed=3)
    expected = {i: alone(engine, p, GREEDY) for i, p in enumerate(ps)}
    no_cache = make_engine(tiny_model_path, index_dir, enable_prefix_caching=False)
    assert run_with_arrivals(no_cache, ps, GREEDY, seed=2) == expected
    # a pool of 8 blocks of 16 tokens cannot hold 8 sequences of ~50 tokens: preemption must happen
    tight = make_engine(tiny_model_path, index_dir, num_kv_blocks=8, ctx_size=128, max_num_seqs=8)
    assert run_with_arrivals(tight, ps, GREEDY, seed=4) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 8


def test_chunked_prefill_matches_one_pass(tiny_model_path, index_dir, engine):
    chunked = make_engine(tiny_model_path, index_dir, max_num_batched_tokens=7)
    p = prompts(1, seed=5)[0] * 3
    assert alone(chunked, p, GREEDY) == alone(engine, p, GREEDY)


def test_prefix_cache_reports_cached_tokens(engine):
    p = list(range(3, 60))
    engine.generate([p], GREEDY)
    second = engine.generate([p + [7, 8]], GREEDY)[0]
    assert second.cached_tokens == 48  # three full blocks of 16


def test_decode_logits_match_one_pass_scoring(engine):
    p = prompts(1, seed=9)[0]
    out = engine.generate([p], GREEDY)[0]
    logits = score_tokens(engine, p + out.token_ids)
    assert logits[len(p) - 1 :].argmax(axis=1)[: len(out.token_ids)].tolist() == out.token_ids


def test_max_tokens_and_finish_reason(engine):
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_context_limit_ends_with_length(tiny_model_path, index_dir):
    small = make_engine(tiny_model_path, index_dir, ctx_size=32)
    out = small.generate(
        [list(range(3, 23))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and out.prompt_tokens + out.generated_tokens == 32


def test_long_prompt_rejected_not_truncated(tiny_model_path, index_dir):
    small = make_engine(tiny_model_path, index_dir, ctx_size=32)
    with pytest.raises(ContextLengthExceededError, match="resulted in 40 tokens"):
        small.add_request(list(range(3, 43)), {"max_tokens": -1})  # -1: until the context is full


def test_prompt_plus_max_tokens_check(tiny_model_path, index_dir):
    """The one rule in OpenAI's words: with max_tokens (as the server asks), prompt + max_tokens must fit."""
    small = make_engine(tiny_model_path, index_dir, ctx_size=32)
    with pytest.raises(ContextLengthExceededError) as e:
        small.check_prompt(20, 13)
    assert str(e.value) == (
        "This model's maximum context length is 32 tokens. However, you requested 33 tokens "
        "(20 in the prompt, 13 in the completion). Please reduce the length of the prompt or completion."
    )
    assert e.value.code == "context_length_exceeded"
    small.check_prompt(20, 12)
    with pytest.raises(ContextLengthExceededError, match="your prompt resulted in 32 tokens"):
        small.add_request(list(range(3, 35)), SamplingParams(max_tokens=1))


def test_check_context_length_wording():
    with pytest.raises(ContextLengthExceededError, match=r"\(90 in the messages, 20 in the completion\)"):
        check_context_length(100, 90, 20, "messages")
    with pytest.raises(ContextLengthExceededError, match="your messages resulted in 100 tokens"):
        check_context_length(100, 100, None, "messages")
    with pytest.raises(LocalLLMError, match="the messages are empty"):
        check_context_length(100, 0, None, "messages")
    check_context_length(100, 80, 20)
    check_context_length(100, 99, None)


def test_sampling_defaults_rule(tiny_model_path, index_dir):
    """A value given > the model's models.toml default > the built-in; SamplingParams are used as given."""
    toml = {"temperature": 0.3, "top_k": 5, "max_tokens": 7, "context": 99, "system": "x"}
    eng = make_engine(tiny_model_path, index_dir, sampling_defaults=toml)
    assert eng.sampling_defaults == {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    params = eng.sampling_params({"top_k": 9, "min_p": None})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 9, 7)
    assert (params.top_p, params.min_p) == (BUILTIN_DEFAULTS["top_p"], BUILTIN_DEFAULTS["min_p"])
    rid = eng.add_request([5, 6, 7], {"seed": 1})
    assert eng.requests[rid].seq.params.max_tokens == 7 and eng.requests[rid].seq.params.seed == 1
    explicit = SamplingParams(temperature=0.9)
    rid = eng.add_request([5, 6, 7], explicit)
    assert eng.requests[rid].seq.params is explicit
    for request_id in list(eng.requests):
        eng.abort(request_id)


def test_empty_prompt_rejected(engine):
    with pytest.raises(LocalLLMError, match="empty"):
        engine.add_request([])


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    ps = prompts(6, seed=11)
    expected = {i: alone(engine, p, params) for i, p in enumerate(ps)}
    assert run_with_arrivals(engine, ps, params, seed=5) == expected


def test_abort_frees_blocks(engine):
    rid = engine.add_request(list(range(3, 40)), GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort(rid)
    assert out.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_and_logprobs(engine):
    p = prompts(1, seed=2)[0]
    first = engine.generate([p], GREEDY)[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first], logprobs=2)
    out = engine.generate([p], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == []
    assert out.logprobs[0].token_id == first and len(out.logprobs[0].top) == 2


def test_token_ids_outside_the_vocabulary_are_refused_before_any_kernel(tiny_model_path, index_dir):
    from localllm.errors import InvalidRequestError

    engine = make_engine(tiny_model_path, index_dir)
    vocab = engine.args.vocab_size
    for bad in ([5, vocab], [-1], [3, 2.5]):
        with pytest.raises(InvalidRequestError, match="not in this model's vocabulary"):
            engine.add_request(bad)
    assert not engine.has_unfinished()
    engine.add_request([5, vocab - 1])  # the last id is fine


def test_a_context_past_the_trained_one_is_warned_about_once(tiny_model_path, index_dir, caplog):
    """The tiny model was trained on 256 tokens and sets no RoPE scaling."""
    with caplog.at_level("WARNING", logger="localllm"):
        make_engine(tiny_model_path, index_dir, ctx_size=512)
    assert [r.getMessage() for r in caplog.records if "exceeds the 256 tokens" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="localllm"):
        make_engine(tiny_model_path, index_dir, ctx_size=256)
    assert not [r for r in caplog.records if "exceeds" in r.getMessage()]
