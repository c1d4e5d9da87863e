"""`localllm perplexity --save-logits / --kl-divergence`: llama.cpp's `_logits_` file (16-bit
log-probabilities) and its KL-divergence statistics, checked against float64 NumPy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from perplexity_text import TEXT
from typer.testing import CliRunner

from localllm.cli import perplexity as _perplexity  # noqa: F401  (registers the command)
from localllm.cli.app import app
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.errors import LocalLLMError
from localllm.kld import KLDStats, percentile
from localllm.logits_file import (
    LogitsReader,
    dequantize_log_probs,
    quantize_log_probs,
    row_width,
    scored_rows,
)
from localllm.perplexity import kl_divergence, perplexity


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_path), threads=2, ctx_size=65, max_num_seqs=1))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    top = x.max(-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))


def test_log_probs_keep_16_nats_at_16_bits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (5, 1001)).astype(np.float32)  # odd vocabulary: rows padded to even
    rows = quantize_log_probs(logits)
    assert rows.shape == (5, row_width(1001)) == (5, 1006) and rows.dtype == np.uint16
    back = dequantize_log_probs(rows, 1001)
    exact = _log_softmax(logits)
    kept = exact > exact.max(-1, keepdims=True) - 16
    step = 16 / 65535
    assert np.abs(back - exact)[kept].max() <= step  # rounding, plus float32 arithmetic
    floor = np.broadcast_to(exact.max(-1, keepdims=True) - 16, exact.shape)  # stored as 0: the floor
    assert (rows[:, 4:1005][~kept] == 0).all() and np.allclose(back[~kept], floor[~kept], atol=1e-4)
    flat = quantize_log_probs(np.zeros((1, 6), np.float32))  # all equal: scale 0, log(1/6) everywhere
    np.testing.assert_allclose(dequantize_log_probs(flat, 6), np.full((1, 6), -math.log(6)), rtol=1e-6)


def test_kld_statistics_match_float64() -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(0, 2, (40, 300)).astype(np.float32)  # within 16 nats: nothing cut off
    model = (base + rng.normal(0, 0.5, base.shape)).astype(np.float32)
    targets = rng.integers(0, 300, 40)
    stats = KLDStats()
    stats.add(model[:25], quantize_log_probs(base[:25]), targets[:25])
    stats.add(model[25:], quantize_log_probs(base[25:]), targets[25:])
    p, q = _log_softmax(base), _log_softmax(model)
    kld = (np.exp(p) * (p - q)).sum(-1)
    nll, nll_base = -q[np.arange(40), targets], -p[np.arange(40), targets]
    s = stats.summary()
    assert s["count"] == 40
    assert s["kld_mean"] == pytest.approx(kld.mean(), abs=2e-4)
    assert s["kld_stderr"] == pytest.approx(kld.std() / math.sqrt(39), rel=1e-2)
    assert s["kld_median"] == pytest.approx(np.median(kld), abs=2e-4)
    assert s["kld_max"] == pytest.approx(kld.max(), abs=2e-4)
    assert s["kld_p99"] == pytest.approx(np.percentile(kld, 99), abs=2e-4)  # numpy's "linear" = ggml's
    assert s["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    assert s["ppl_base"] == pytest.approx(math.exp(nll_base.mean()), rel=1e-3)
    assert s["ppl_diff"] == pytest.approx(s["ppl"] - s["ppl_base"])
    same = (model.argmax(-1) == base.argmax(-1)).mean()
    assert s["same_top_p"] == same and 0 < same < 1
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    assert s["p_diff_rms"] == pytest.approx(math.sqrt((p_diff**2).mean()), rel=1e-3)
    assert percentile(np.array([0.0, 1.0, 2.0]), 0.75) == 1.5


def test_a_model_against_its_own_logits(engine, tmp_path) -> None:
    path = tmp_path / "base.logits"
    result = perplexity(engine, TEXT * 2, n_ctx=64, save_logits=path)
    reader = LogitsReader(path)
    assert (reader.n_ctx, reader.n_vocab, reader.n_chunk) == (64, engine.args.vocab_size, result.n_chunks)
    assert reader.tokens.tolist() == engine.tokenizer.encode(TEXT * 2)[: 64 * result.n_chunks]
    reader.close()
    expected_size = (
        20
        + 4 * 64 * result.n_chunks
        + 2 * result.n_chunks * scored_rows(64) * row_width(engine.args.vocab_size)
    )
    assert path.stat().st_size == expected_size
    r = kl_divergence(engine, path)
    assert r["count"] == result.n_scored and r["n_chunks"] == result.n_chunks
    assert r["ppl"] == pytest.approx(result.ppl, rel=1e-6)
    assert r["ppl_base"] == pytest.approx(result.ppl, rel=1e-3)  # through 16-bit log-probabilities
    assert r["kld_mean"] < 1e-6 and r["kld_max"] < 1e-5 and r["same_top_p"] == 1.0
    assert not list(tmp_path.glob(".*.part"))


def test_cli_save_then_compare(tiny_model_path, engine, tmp_path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    text, base = tmp_path / "text.txt", tmp_path / "base.logits"
    text.write_text(TEXT * 2)
    model = str(tiny_model_path)
    saved = CliRunner().invoke(app, ["perplexity", model, str(text), "-c", "64", "--save-logits", str(base)])
    assert saved.exit_code == 0 and base.exists(), saved.output
    again = CliRunner().invoke(app, ["perplexity", model, str(text), "-c", "64", "--save-logits", str(base)])
    assert again.exit_code != 0 and "exists; pass --force" in str(again.exception)
    compared = CliRunner().invoke(app, ["perplexity", model, "-", "--kl-divergence", str(base), "--json"])
    assert compared.exit_code == 0, compared.output
    data = json.loads(compared.stdout)
    assert data["n_ctx"] == 64 and data["same_top_p"] == 1.0 and data["kld_mean"] < 1e-6
    plain = CliRunner().invoke(app, ["perplexity", model, "-", "--kl-divergence", str(base)])
    assert "KLD: mean" in plain.stdout and "Same top token: 100.000" in plain.stdout
    base.write_bytes(base.read_bytes()[:-100])
    with pytest.raises(LocalLLMError, match="is truncated"):
        kl_divergence(engine, base)


def test_not_a_logits_file(tmp_path) -> None:
    (tmp_path / "x").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(LocalLLMError, match="is not a logits file"):
        LogitsReader(tmp_path / "x")
