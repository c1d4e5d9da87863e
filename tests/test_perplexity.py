"""`localllm perplexity`: llama-perplexity's chunking and arithmetic, checked against NumPy from the
same logits on the tiny model, and the real SmolLM2 on a short text."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from perplexity_text import TEXT  # noqa: F401
from typer.testing import CliRunner

from localllm.cli import perplexity as _perplexity  # noqa: F401  (registers the command)
from localllm.cli.app import app
from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import LocalLLMError
from localllm.perplexity import NLLStats, make_chunks, perplexity, read_text, token_nlls


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_path), threads=2, ctx_size=65, max_num_seqs=1))


def _numpy_reference(engine: LLMEngine, text: str, n_ctx: int) -> tuple[float, float, int]:
    """llama-perplexity's estimate written out plainly in float64: (ppl, its error, tokens scored)."""
    tokens = engine.tokenizer.encode(text, add_special=True)
    nlls = []
    for i in range(len(tokens) // n_ctx):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if engine.tokenizer.add_bos:
            chunk[0] = engine.tokenizer.bos_id
        logits = np.asarray(score_tokens(engine, chunk), np.float64)
        top = logits.max(-1, keepdims=True)
        log_probs = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
        for pos in range(n_ctx // 2, n_ctx - 1):
            nlls.append(-log_probs[pos, chunk[pos + 1]])
    nll = np.array(nlls)
    ppl = math.exp(nll.mean())
    return ppl, ppl * nll.std() / math.sqrt(len(nll) - 1), len(nll)


def test_perplexity_matches_numpy_from_the_same_logits(engine) -> None:
    text = TEXT * 2
    assert not engine.tokenizer.add_bos  # the tiny BPE vocabulary adds no BOS: chunks are plain slices
    seen = []
    result = perplexity(engine, text, n_ctx=64, on_chunk=lambda done, total, s: seen.append((done, total)))
    ppl, err, count = _numpy_reference(engine, text, 64)
    n_tokens = len(engine.tokenizer.encode(text))
    assert result.n_tokens == n_tokens and result.n_chunks == n_tokens // 64 >= 2
    assert result.n_scored == count == result.n_chunks * 31  # 64 // 2 .. 62 predict tokens 33 .. 63
    assert result.ppl == pytest.approx(ppl, rel=1e-6) and result.ppl_stderr == pytest.approx(err, rel=1e-4)
    assert seen == [(i, result.n_chunks) for i in range(1, result.n_chunks + 1)]
    assert result.chunk_ppls[-1] == result.ppl and result.mean_nll == pytest.approx(math.log(ppl))
    limited = perplexity(engine, text, n_ctx=64, n_chunks=1)
    assert limited.n_chunks == 1 and limited.ppl == pytest.approx(result.chunk_ppls[0], rel=1e-12)


def test_chunks_start_with_bos_when_the_tokenizer_adds_it() -> None:
    tokens = [1, *range(100, 109)]  # BOS 1, then 9 text tokens
    assert make_chunks(tokens, 4, bos_id=1) == [[1, 100, 101, 102], [1, 104, 105, 106]]
    assert make_chunks(tokens, 4, bos_id=None) == [[1, 100, 101, 102], [103, 104, 105, 106]]
    assert make_chunks(tokens, 4, None, n_chunks=1) == [[1, 100, 101, 102]]
    with pytest.raises(LocalLLMError, match="you need at least 12 tokens .* context of 6; .* only 10"):
        make_chunks(tokens, 6, None)


def test_nll_arithmetic() -> None:
    logits = np.array([[0.0, math.log(3.0)], [5.0, 5.0]], np.float32)  # p = 1/4, 3/4; 1/2, 1/2
    np.testing.assert_allclose(token_nlls(logits, [0, 1]), [math.log(4), math.log(2)], rtol=1e-6)
    stats = NLLStats()
    stats.add(np.array([1.0, 2.0]))
    stats.add(np.array([3.0]))
    assert (stats.count, stats.mean_nll, stats.ppl) == (3, 2.0, math.exp(2.0))
    # population variance 2/3, over count - 1 = 2: the standard error of the mean is 1/sqrt(3)
    assert stats.nll_stderr == pytest.approx(1 / math.sqrt(3)) and stats.ppl_stderr == pytest.approx(
        math.exp(2.0) / math.sqrt(3)
    )


def test_read_text_drops_one_trailing_newline(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("one\n\n")
    assert read_text(tmp_path / "a.txt") == "one\n"
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe")
    with pytest.raises(LocalLLMError, match="not UTF-8"):
        read_text(tmp_path / "b.bin")
    with pytest.raises(LocalLLMError, match="cannot read"):
        read_text(tmp_path / "missing.txt")


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    return {"COLUMNS": "160"}


def test_cli_json_and_final_line(tiny_model_path, engine, tmp_path, env) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 2)
    args = ["perplexity", str(tiny_model_path), str(text), "-c", "64", "-t", "2"]
    result = CliRunner().invoke(app, [*args, "--json"], env=env)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    expected = perplexity(engine, read_text(text), n_ctx=64)
    assert data["ppl"] == pytest.approx(expected.ppl, rel=1e-9) and data["n_chunks"] == expected.n_chunks
    plain = CliRunner().invoke(app, args, env=env)
    assert plain.exit_code == 0, plain.output
    assert f"Final estimate: PPL = {expected.ppl:.4f} +/- {expected.ppl_stderr:.5f}" in plain.stdout
    assert f"[1/{expected.n_chunks}] PPL" in plain.stderr  # not a terminal: one line per chunk


def test_cli_too_short_text_is_one_line(tiny_model_path, tmp_path, env) -> None:
    text = tmp_path / "short.txt"
    text.write_text("too short")
    result = CliRunner().invoke(app, ["perplexity", str(tiny_model_path), str(text), "-c", "64"], env=env)
    assert result.exit_code != 0 and "you need at least 128 tokens" in str(result.exception)


@pytest.mark.slow
def test_smollm2_perplexity_on_a_short_text(smollm2_path, model_index_dir) -> None:
    config = EngineConfig(
        model=str(smollm2_path), threads=2, ctx_size=129, max_num_seqs=1, index_dir=model_index_dir
    )
    engine = LLMEngine(config)
    result = perplexity(engine, TEXT * 2, n_ctx=128)
    ppl, err, count = _numpy_reference(engine, TEXT * 2, 128)
    assert result.n_chunks >= 2 and result.n_scored == count
    assert result.ppl == pytest.approx(ppl, rel=1e-6) and result.ppl_stderr == pytest.approx(err, rel=1e-4)
    # a fluent English story, and its second copy is easy to predict: a real model is far below the
    # vocabulary's 49152 (a uniform guess) and well above 1
    assert 1.2 < result.ppl < 40, result
