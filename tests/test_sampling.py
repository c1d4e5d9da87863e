"""Sampling: greedy, temperature, top-k/top-p/min-p, penalties, logit bias, seeds, stop strings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.detokenizer import StopChecker
from localllm.errors import LocalLLMError
from localllm.sampler import apply_penalties, log_softmax, make_generator, sample, top_logprobs
from localllm.sampling_params import SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], dtype=np.float32)


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> set[int]:
    rng = make_generator(seed)
    return {sample(LOGITS, params, rng) for _ in range(n)}


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), make_generator(0)) == 1


def test_top_k_limits_candidates():
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {1, 4}


def test_top_p_keeps_the_nucleus():
    # probabilities ~ [.05, .37, .14, .03, .34]: 0.5 needs the two best
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {1, 4}


def test_min_p_drops_unlikely_tokens():
    assert draws(SamplingParams(temperature=1.0, min_p=0.3)) == {1, 2, 4}


def test_high_temperature_reaches_everything():
    assert draws(SamplingParams(temperature=5.0)) == {0, 1, 2, 3, 4}


def test_seed_reproducible_and_independent_of_other_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(LOGITS, params, make_generator(7)) for _ in range(1)]
    rng = make_generator(7)
    b = [sample(LOGITS, params, rng) for _ in range(20)]
    assert a[0] == b[0]
    assert [sample(LOGITS, params, r) for r in [make_generator(7)] * 20] == b


def test_logit_bias_can_force_or_ban():
    params = SamplingParams(temperature=0, logit_bias={3: 100.0})
    assert sample(apply_penalties(LOGITS, params, [], []), params, make_generator(0)) == 3
    params = SamplingParams(temperature=0, logit_bias={1: -100.0})
    assert sample(apply_penalties(LOGITS, params, [], []), params, make_generator(0)) == 4


def test_repeat_penalty_llama_cpp_style():
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=2)
    out = apply_penalties(np.array([2.0, -2.0, 4.0], np.float32), params, [0, 1], [2])
    # only the last two tokens (1 and 2) are in the window: positive divided, negative multiplied
    np.testing.assert_allclose(out, [2.0, -4.0, 2.0])


def test_presence_and_frequency_penalties_count_generated_tokens():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(np.zeros(3, np.float32), params, [0, 0, 0], [1, 1, 2])
    np.testing.assert_allclose(out, [0.0, -1.0, -0.75])


def test_no_penalties_no_copy():
    assert apply_penalties(LOGITS, SamplingParams(), [1], [1]) is LOGITS


def test_logprobs_sorted_and_normalised():
    lp = log_softmax(LOGITS)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    top = top_logprobs(lp, 3)
    assert [t for t, _ in top] == [1, 4, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"min_p": 2},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop": [str(i) for i in range(65)]},  # per-request cost bounds
        {"stop": ["x" * 1001]},
        {"logit_bias": {i: 1.0 for i in range(1025)}},
    ],
)
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(LocalLLMError):
        SamplingParams(**kwargs)


def test_stop_string_held_back_then_cut():
    checker = StopChecker(["</end>"])
    assert checker.feed("Hello </e") == ("Hello ", None)
    assert checker.feed("nd> tail") == ("", "</end>")


def test_stop_string_partial_released_when_it_cannot_match():
    checker = StopChecker(["STOP"])
    assert checker.feed("ST") == ("", None)
    assert checker.feed("AR") == ("STAR", None)
    assert checker.flush() == ""


class ScanStops:
    """The twin of StopChecker: rescans everything held back on every feed (the code it replaced)."""

    def __init__(self, stop: list[str]):
        self.stop, self.pending = stop, ""

    def feed(self, text: str) -> tuple[str, str | None]:
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stop if s in self.pending]
        if hits:
            index, stop = min(hits)
            out, self.pending = self.pending[:index], ""
            return out, stop
        keep = max(
            [n for s in self.stop for n in range(1, len(s)) if self.pending.endswith(s[:n])], default=0
        )
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out, None


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=6),
    chunks=st.lists(st.text(alphabet="abcd", max_size=6), max_size=12),
)
def test_stop_automaton_matches_its_scanning_twin(stops: list[str], chunks: list[str]) -> None:
    fast, slow = StopChecker(stops), ScanStops(stops)
    for chunk in chunks:
        got = fast.feed(chunk)
        assert got == slow.feed(chunk), (stops, chunks)
        if got[1] is not None:
            break
    else:
        assert fast.flush() == slow.pending


def test_stop_matching_is_linear_in_the_output() -> None:
    """1,800 stops of 2,000 characters that the output keeps almost matching (what took 830 CPU-s of
    the engine thread): the automaton holds back exactly the live prefix, at a cost per character that
    does not grow with the stops (the time is printed, not asserted)."""
    import time

    stops = ["x" * 1999 + str(i) for i in range(1800)]
    checker = StopChecker(stops)
    start = time.process_time()
    for _ in range(2000):
        checker.feed("xx")
    elapsed = time.process_time() - start
    print(f"4,000 characters against 1,800 stops of 2,000: {elapsed * 1e3:.1f} ms")  # ~6 ms here
    assert checker.pending == "x" * 1999  # held back: what could still become a stop
    assert checker.feed("7") == ("", "x" * 1999 + "7")


# ---------------------------------------------------------------- defaults: one rule for every front end


def test_resolve_sampling_rule():
    """A value given > the model's default > the built-in; None means "not given"."""
    from localllm.sampling_params import BUILTIN_DEFAULTS, OPENAI_DEFAULTS, resolve_sampling

    model = {"temperature": 0.2, "top_k": 64}
    p = resolve_sampling({"temperature": None, "top_k": 3, "seed": 5}, model)
    assert (p.temperature, p.top_k, p.seed) == (0.2, 3, 5)
    assert (p.top_p, p.min_p, p.max_tokens) == (
        BUILTIN_DEFAULTS["top_p"],
        BUILTIN_DEFAULTS["min_p"],
        BUILTIN_DEFAULTS["max_tokens"],
    )
    openai = resolve_sampling({}, model, OPENAI_DEFAULTS)
    assert (openai.temperature, openai.top_p, openai.max_tokens) == (0.2, 1.0, None)
    assert resolve_sampling({"max_tokens": -1}).max_tokens is None  # -1: until the context is full
    with pytest.raises(LocalLLMError, match="unknown sampling parameter"):
        resolve_sampling({"temprature": 1.0})
    with pytest.raises(LocalLLMError, match="top_p"):
        resolve_sampling({"top_p": 2.0})


def test_model_defaults_come_from_models_toml_over_the_gguf():
    from localllm.sampling_params import model_sampling_defaults

    metadata = {
        "general.sampling.temp": np.float32(0.6),
        "general.sampling.top_k": np.uint32(20),
        "general.sampling.top_p": 7.0,  # out of range: ignored, not an error on every request
        "general.sampling.min_p": "x",
    }
    toml = {"top_k": 50, "context": 4096, "chat_template": "{{ x }}", "repeat_penalty": None}
    assert model_sampling_defaults(toml, metadata) == {"temperature": pytest.approx(0.6), "top_k": 50}
    assert model_sampling_defaults() == {}


def test_server_requests_follow_the_same_rule():
    """The server: request fields > the model's defaults > OpenAI's built-ins."""
    from localllm.server.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest(messages=messages, top_p=0.5)
    p = body.sampling_params(None, None, {"temperature": 0.3, "top_p": 0.9, "max_tokens": 12})
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (0.3, 0.5, 12, 0)
    plain = ChatCompletionRequest(messages=messages).sampling_params(None, None)
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 1.0, None)
    greedy = ChatCompletionRequest(messages=messages, temperature=0, top_k=-1).sampling_params(7, None)
    assert (greedy.temperature, greedy.top_k, greedy.max_tokens) == (0.0, 0, 7)


def _distribution_by_full_sort(logits, params):
    """distribution() as it was written first: the whole vocabulary sorted, then cut."""
    from localllm.sampler import _top_k_candidates

    candidates = _top_k_candidates(logits, params.top_k)
    scaled = logits[candidates].astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    candidates, scaled = candidates[order], scaled[order]
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    keep = len(probs)
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    return candidates[:keep], probs[:keep] / probs[:keep].sum()


def test_distribution_sorts_only_survivors_but_keeps_the_same_tokens():
    from localllm.sampler import distribution

    rng = np.random.default_rng(1)
    for trial in range(200):
        vocab = int(rng.choice([50, 1000, 49152]))
        logits = (rng.standard_normal(vocab) * rng.choice([0.5, 3, 10])).astype(np.float32)
        if trial % 5 == 0:
            logits[rng.integers(0, vocab, 10)] = logits.max()  # ties at the top
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.8, 1.5])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.99])),
            min_p=float(rng.choice([0.0, 0.05, 0.2])),
            top_k=int(rng.choice([0, 0, 40])),
        )
        got, got_p = distribution(logits, params)
        want, want_p = _distribution_by_full_sort(logits, params)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got_p, want_p, rtol=1e-12, atol=1e-15)
