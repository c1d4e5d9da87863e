"""The device sampler (torch, on the CPU here) picks the host sampler's tokens (localllm/sampler.py)
for fixed seeds, with every rule on: temperature, top-k, top-p, min-p, penalties, logit_bias, grammar
masks, and reports the same log-probabilities, in one batch of mixed rows."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'localllm[torch]')")
import torch  # noqa: E402

from localllm.backends.base import SampleRow
from localllm.backends.torch_backend.sampling import pack_allowed, sample_batch  # noqa: E402
from localllm.sampler import apply_penalties, log_softmax, make_generator, sample, token_generator  # noqa: E402
from localllm.sampler import top_logprobs as host_top_logprobs  # noqa: E402
from localllm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=20, seed=2),
    SamplingParams(temperature=1.2, top_p=0.9, seed=3),
    SamplingParams(temperature=0.7, min_p=0.05, seed=4, logprobs=3),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.02, seed=5),
    SamplingParams(temperature=0.9, repeat_penalty=1.3, repeat_last_n=16, seed=6, logprobs=0),
    SamplingParams(temperature=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=7),
    SamplingParams(temperature=0, logit_bias={5: 30.0, 7: -100.0}, repeat_penalty=1.1, logprobs=5),
    SamplingParams(temperature=1.0),  # unseeded: draws from the sequence's own generator
]


def host_sample(logits: np.ndarray, row: SampleRow) -> tuple[int, float | None, list | None]:
    """ModelRunner._sample's steps, on the host (the generator is a fresh copy of the row's)."""
    p = row.params
    processed = apply_penalties(logits, p, row.prompt_ids, row.output_ids)
    if row.allowed is not None:
        processed = np.where(row.allowed, processed, np.float32(-np.inf)).astype(np.float32)
    token = sample(processed, p, token_generator(p.seed, row.rng, len(row.output_ids)))
    if p.logprobs is None:
        return token, None, None
    lp = log_softmax(logits)
    return token, float(lp[token]), host_top_logprobs(lp, p.logprobs)


def make_rows(rng: np.random.Generator, step: int) -> list[SampleRow]:
    rows = []
    for i, p in enumerate(PARAMS):
        history = rng.integers(0, VOCAB, size=30 + step).tolist()
        allowed = rng.random(VOCAB) < 0.3 if i in (3, 8) else None  # a grammar on two of the rows
        rows.append(SampleRow(p, history[:20], history[20:], make_generator(100 + i), allowed))
    return rows


def clone(rows: list[SampleRow]) -> list[SampleRow]:
    """The same rows with copies of their shared generators (each side draws once)."""
    out = []
    for r in rows:
        rng = np.random.Generator(type(r.rng.bit_generator)())
        rng.bit_generator.state = r.rng.bit_generator.state
        out.append(SampleRow(r.params, r.prompt_ids, r.output_ids, rng, r.allowed))
    return out


@pytest.mark.parametrize("step", range(6))
def test_device_sampler_picks_the_host_samplers_tokens(step: int) -> None:
    rng = np.random.default_rng(step)
    logits = (rng.standard_normal((len(PARAMS), VOCAB)) * 3).astype(np.float32)
    rows = make_rows(rng, step)
    expected = [host_sample(logits[i], r) for i, r in enumerate(clone(rows))]
    got = sample_batch(torch.from_numpy(logits), rows)
    for i, (g, (token, lp, tops)) in enumerate(zip(got, expected, strict=True)):
        assert g.token_id == token, (i, PARAMS[i])
        if lp is None:
            assert g.logprob is None and g.top_logprobs is None
            continue
        assert g.logprob == pytest.approx(lp, abs=1e-6)
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in tops]
        assert np.allclose([v for _, v in g.top_logprobs], [v for _, v in tops], atol=1e-6)


def test_many_seeds_agree_and_draws_spread() -> None:
    """Over many seeds (one row each, in one batch) every token agrees, and the draws really vary."""
    rng = np.random.default_rng(9)
    logits = np.tile((rng.standard_normal(VOCAB) * 2).astype(np.float32), (64, 1))
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in range(64)]
    rows = [SampleRow(p, [1, 2], [3] * (s % 5), make_generator(None)) for s, p in enumerate(params)]
    expected = [host_sample(logits[i], r)[0] for i, r in enumerate(rows)]  # seeded: no shared draws
    got = [s.token_id for s in sample_batch(torch.from_numpy(logits), rows)]
    assert got == expected
    assert len(set(got)) > 5


def test_packed_mask_bits() -> None:
    allowed = np.zeros(20, dtype=bool)
    allowed[[0, 9, 19]] = True
    packed = pack_allowed(allowed, 20)
    assert packed.tolist() == [1, 2, 8]  # token t is bit t % 8 of byte t // 8


def test_engine_draws_on_the_device_as_on_the_host(tiny_model_path) -> None:
    """The engine with the backend sampling (as on a GPU) gives every request the tokens and
    log-probabilities the host sampler gives it: seeded, penalised, greedy with bias, unseeded."""
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    def engine(on_device: bool) -> LLMEngine:
        config = EngineConfig(model=str(tiny_model_path), backend="torch", device="cpu", threads=1,
                              max_num_seqs=4, ctx_size=128)  # fmt: skip
        e = LLMEngine(config)
        e.backend.samples_on_device = on_device
        return e

    common = {"max_tokens": 10, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=2, **common),
        SamplingParams(temperature=1.0, top_k=30, min_p=0.05, repeat_penalty=1.2, seed=12, **common),
        SamplingParams(temperature=0, logit_bias={40: 2.0}, frequency_penalty=0.4, logprobs=0, **common),
        SamplingParams(temperature=1.0, presence_penalty=0.3, seed=13, **common),
    ]
    prompts = [list(range(5, 5 + n)) for n in (7, 12, 3, 20)]
    host = engine(False).generate(prompts, params)
    on_device, drawn = engine(True), []
    sample = on_device.backend.sample
    on_device.backend.sample = lambda logits, rows: drawn.append(len(rows)) or sample(logits, rows)
    device = on_device.generate(prompts, params)
    assert sum(drawn) == 40  # every token was drawn there
    for h, d in zip(host, device, strict=True):
        assert d.token_ids == h.token_ids
        assert [x.token_id for x in d.logprobs] == [x.token_id for x in h.logprobs]
        assert np.allclose([x.logprob for x in d.logprobs], [x.logprob for x in h.logprobs], atol=1e-5)
        assert [[t for t, _ in x.top] for x in d.logprobs] == [[t for t, _ in x.top] for x in h.logprobs]
    assert len({tuple(o.token_ids) for o in device}) == 4
