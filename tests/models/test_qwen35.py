"""qwen35, qwen35moe and qwen3next (Gated DeltaNet hybrids) against llama.cpp's fixtures, and the engine
around their recurrent state: batching, chunked prefill and preemption never change greedy output, the
state pool is what `info` says and its slots come back, what cannot work is refused in one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from arch_conformance import compare, engine, greedy, greedy_problem, load_fixture, teacher_forced
from engine_scenarios import alone, run_with_arrivals
from tiny_hybrid import HYBRID_VARIANTS, write_hybrid

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.errors import ConfigError, ModelFormatError
from localllm.sampling_params import SamplingParams

FIXED = ["qwen35", "qwen35moe", "qwen3next"]  # the variants with llama.cpp fixtures
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hybrid")
    return {v: write_hybrid(d / f"{v}.gguf", v) for v in HYBRID_VARIANTS}


def make(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), threads=2, ctx_size=kw.pop("ctx_size", 256), **kw))


@pytest.mark.parametrize("variant", FIXED)
def test_file_is_the_one_llama_cpp_ran(files, variant: str) -> None:
    ref = load_fixture(variant)
    assert hashlib.sha256(files[variant].read_bytes()).hexdigest() == ref["sha256"], "regenerate the fixtures"
    assert len(ref["prompt"]) > 64  # llama.cpp's prefill crosses its delta-rule chunk


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("variant", FIXED)
def test_conforms_to_llama_cpp(files, variant: str, fuse: bool) -> None:
    """Teacher-forced top-1 at least 95% over prompt and continuation (the Numba path rounds
    activations to 8 bits as llama.cpp does), free-running greedy equal up to the first near-tie."""
    ref = load_fixture(variant)
    e = engine(files[variant], fuse=fuse)
    assert e.backend.fused(e.model) == fuse
    figures = compare(teacher_forced(e, ref), ref, near=0.5)["figures"]
    assert figures["agree_all"] >= 0.95, figures
    assert figures["top8_shared"] >= 6, figures
    assert greedy_problem(greedy(e, ref), ref) is None


def test_float_paths_agree_with_the_numpy_oracle(files) -> None:
    """On float32 weights the NumPy reference (chunkwise delta rule in prefill), the op path and the
    fused stack compute the same logits to float rounding."""
    ref = load_fixture("qwen35")
    ids = {"prompt": ref["prompt"], "greedy": ref["greedy"]}
    oracle = teacher_forced(files["qwen35_f32"], ids, "numpy")
    for fuse in (False, True):
        ours = teacher_forced(engine(files["qwen35_f32"], fuse=fuse), ids)
        assert np.abs(ours - oracle).max() / np.abs(oracle).max() < 1e-3


@pytest.mark.parametrize("variant", FIXED)
def test_fused_stack_equals_the_op_path(files, variant: str) -> None:
    ref = load_fixture(variant)
    e = engine(files[variant])
    fused = teacher_forced(e, ref)
    e.backend.fuse_layers = False
    ops = teacher_forced(e, ref)
    assert np.abs(fused - ops).max() / np.abs(ops).max() < 1e-4


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 269, size=int(rng.integers(5, 70))).tolist() for _ in range(n)]


@pytest.mark.parametrize("variant", ["qwen35", "qwen3next"])
def test_sixteen_batched_equal_each_alone(files, variant: str) -> None:
    e = make(files[variant])
    ps = prompts(16, seed=1)
    expected = {i: alone(e, p, GREEDY) for i, p in enumerate(ps)}
    assert run_with_arrivals(e, ps, GREEDY, seed=1) == expected
    slots = e.block_manager.state_slots
    assert slots is not None and slots.num_free == slots.num_slots == 17


def test_preempted_and_chunked_equal_alone(files) -> None:
    e = make(files["qwen35"])
    ps = prompts(8, seed=2)
    expected = {i: alone(e, p, GREEDY) for i, p in enumerate(ps)}
    # 8 blocks of 16 tokens cannot hold 8 sequences of up to 80 tokens: preemption must happen
    tight = make(files["qwen35"], num_kv_blocks=8, ctx_size=128, max_num_seqs=8, max_num_batched_tokens=24)
    assert run_with_arrivals(tight, ps, GREEDY, seed=3) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.state_slots.num_free == 9


def test_state_pool_is_sized_at_start_up(files) -> None:
    e = make(files["qwen35"], max_num_seqs=4)
    states = e.kv_cache.states
    # 3 recurrent layers; per sequence a (taps-1, channels) conv window and (Hv, D, D) delta-rule state
    per_seq = 3 * 4 * (3 * (2 * 2 + 4) * 32 + 4 * 32 * 32)
    assert states.layout.bytes_per_sequence == per_seq
    assert states.nbytes == 5 * per_seq == sum(a.nbytes for a in states.arrays)
    snapshots = e.block_manager.snapshots
    assert snapshots.nbytes == 2 * per_seq
    from localllm.model_info import summarize

    info = summarize(e.gguf)  # what `info` shows, from the metadata alone
    assert info.recurrent_layers == 3
    assert info.memory(max_num_seqs=4)["state_pool_bytes"] == states.nbytes + snapshots.nbytes
    assert info.kv_bytes_per_token == 2 * 1 * 2 * 32 * 2  # the one attention layer's f16 keys and values


def test_speculative_decoding_and_torch_are_refused(files) -> None:
    with pytest.raises(ConfigError, match="speculative decoding is not supported on qwen35"):
        make(files["qwen35"], prompt_lookup=True)
    pytest.importorskip("torch")
    with pytest.raises(ModelFormatError, match="does not run gated_delta_net layers"):
        make(files["qwen35"], backend="torch")


def test_second_turn_resumes_from_a_state_snapshot(files) -> None:
    """A second turn repeating the first turn's prompt and reply restarts from the state kept at the
    reply's last block boundary: the same tokens as a cold engine, most of the prompt cached."""
    e = make(files["qwen35"], ctx_size=512)
    cold = make(files["qwen35"], ctx_size=512, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = prompts(1, seed=4)[0] * 3
    reply = e.generate([first], params)[0].token_ids
    second = first + reply + [5, 6, 7, 8, 9]
    out = e.generate([second], params)[0]
    boundary = (len(first) + len(reply) - 1) // 16 * 16  # the last one the first turn computed past
    assert out.cached_tokens == boundary and e.block_manager.snapshots.restored == 1
    assert out.token_ids == cold.generate([second], params)[0].token_ids
