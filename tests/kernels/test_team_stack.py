"""kernels/team_stack.py computes the same bits as decoder_stack's launch per projection, on 1 and 2 threads,
for a prompt and for batched decode steps, over every dense layer feature; and its pieces split evenly."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_arch import write_arch_model, write_variant

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.kernels import pieces, team_stack
from localllm.sampling_params import SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens: past the tiny files' 16-token windows
DECODE_PROMPTS = [list(range(7, 30)), [9, 10, 11], list(range(40, 57))]

# (file maker, what it exercises beyond a plain llama layer)
FILES = {
    "llama-Q8_0": lambda p: write_arch_model(p, "llama", "Q8_0"),  # window, linear RoPE scaling
    "qwen2-Q5_0": lambda p: write_arch_model(p, "qwen2", "Q5_0"),  # q/k/v biases, NEOX RoPE
    # q/k norms, post-norms, GeGLU, int16 down
    "gemma3-Q8_0": lambda p: write_arch_model(p, "gemma3", "Q8_0"),
    "gemma3-Q5_0": lambda p: write_arch_model(p, "gemma3", "Q5_0"),  # two-pass down projection
    "gemma3-F32": lambda p: write_arch_model(p, "gemma3", "F32"),  # the float path (GEMM)
    "gemma2": lambda p: write_variant(p, "gemma2"),  # attention soft-cap
    "mistral3": lambda p: write_variant(p, "mistral3", "Q8_0"),  # attention temperature, YaRN
    "smollm3": lambda p: write_variant(p, "smollm3", "Q8_0"),  # NoPE layers
    "gemma4": lambda p: write_variant(p, "gemma4"),  # v from k, v norm, shared KV layers, layer scales
}


def _logits(engine: LLMEngine, team: bool, threads: int, monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """A prompt's logits at every position, then each step's logits while three sequences decode."""
    ran = []
    run = team_stack.team_stack
    monkeypatch.setattr(team_stack, "team_stack", lambda x, *a: ran.append(x.shape[0]) or run(x, *a))
    backend = engine.backend
    backend.team_stack, backend.threads = team, threads
    engine.backend.thread_governor(engine.model).candidates = [threads]
    out = [np.asarray(score_tokens(engine, PROMPT))]
    forward = engine.model.forward
    try:
        engine.model.forward = lambda batch, kv: out.append(np.array(forward(batch, kv))) or out[-1]
        engine.generate(DECODE_PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        del engine.model.forward
    assert (len(DECODE_PROMPTS) in ran) == team  # the decode steps ran on the team, or did not
    return out


@pytest.mark.parametrize("name", list(FILES))
def test_team_stack_computes_the_launches_bits(tmp_path, monkeypatch, name: str) -> None:
    path = FILES[name](tmp_path / f"{name}.gguf")
    engine = LLMEngine(EngineConfig(model=str(path), threads=2, ctx_size=128, enable_prefix_caching=False))
    assert engine.backend._plan(engine.model).team, "a dense model should run on the team"
    for threads in (1, 2):
        launches, team = (
            _logits(engine, False, threads, monkeypatch),
            _logits(engine, True, threads, monkeypatch),
        )
        assert len(team) == len(launches) > 3
        for a, b in zip(team, launches, strict=True):
            np.testing.assert_array_equal(a, b)


def test_pieces_hold_equal_bytes_and_a_whole_number_per_thread() -> None:
    """q/k/v of a 1024-wide decode step: q and k Q4_K (36,864 bytes a tile), v Q6_K (53,760)."""
    table = np.array([[0, 0, 589824, 1024, 1024], [0, 0, 147456, 256, 1024], [0, 0, 215040, 256, 1024]])
    tiles, bounds = pieces.plan_pieces(table, 2, 32)
    assert list(tiles) == [0, 16, 20, 24]
    assert len(bounds) == 3  # one piece a thread: 24 tiles of 32 blocks are under 2 x 4 x MIN_PIECE_WORK
    per_tile = np.repeat([36864, 36864, 53760], [16, 4, 4])
    first, second = per_tile[: bounds[1]].sum(), per_tile[bounds[1] :].sum()
    assert abs(first - second) <= per_tile.max()
    # a big launch: PIECES_PER_THREAD each, equal tiles of one kind
    big = pieces.plan_pieces(np.array([[0, 0, 41287680, 49152, 1024]]), 2, 64)[1]
    assert len(big) == 2 * pieces.PIECES_PER_THREAD + 1 and len(set(np.diff(big))) == 1
    assert list(pieces.plan_pieces(table, 1, 32)[1]) == [0, 24]  # one thread: one piece
