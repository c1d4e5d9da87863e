"""The q8_0 KV cache in the engine: pool sizing (34 bytes per 32 values), the fused stack, the op path
and the NumPy backend agreeing on it, its refusals, and the disk tier restoring it bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_arch import Shape, write_arch_model

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine, score_tokens
from localllm.errors import ConfigError
from localllm.sampling_params import SamplingParams

HD32 = Shape(dim=128, heads=4, kv_heads=2, head_dim=32)  # one q8_0 block per head
IDS = list(range(5, 70))


@pytest.fixture(scope="module")
def hd32_path(tmp_path_factory: pytest.TempPathFactory):
    return write_arch_model(
        tmp_path_factory.mktemp("q8") / "qwen2-hd32.gguf", "qwen2", n_layers=2, shape=HD32
    )


def _engine(path, cache: str = "q8_0", backend: str = "numba", **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(path), backend=backend, threads=2, cache_type_k=cache, cache_type_v=cache, **kw
    )
    return LLMEngine(config)


def test_a_q8_0_pool_takes_34_bytes_per_32_values(hd32_path) -> None:
    q8, f16 = _engine(hd32_path, kv_cache_mb=1), _engine(hd32_path, "f16", kv_cache_mb=1)
    assert q8.kv_cache.k.dtype == np.int8 and q8.kv_cache.k.shape[-1] == 34
    assert q8.kv_bytes_per_token == 2 * 2 * HD32.kv_heads * 34  # K and V, 2 layers
    assert q8.kv_bytes_per_token / f16.kv_bytes_per_token == 34 / 64 <= 0.55
    assert q8.kv_capacity_tokens >= f16.kv_capacity_tokens * 64 // 34 - 16
    per_block = q8.kv_cache.k[:, 0].nbytes + q8.kv_cache.v[:, 0].nbytes
    assert per_block == q8.kv_bytes_per_token * q8.kv_cache.block_size


def test_fused_stack_op_path_and_numpy_agree_on_a_q8_0_cache(hd32_path) -> None:
    fused = _engine(hd32_path)
    assert fused.backend.fused(fused.model)
    op = _engine(hd32_path)
    op.backend.fuse_layers = False
    twin = _engine(hd32_path, backend="numpy")
    a, b, c = (np.asarray(score_tokens(e, IDS)) for e in (fused, op, twin))
    scale = np.abs(c).max()
    assert np.abs(a - b).max() / scale < 1e-4
    assert np.abs(a - c).max() / scale < 0.02  # (8-bit activations in the Numba matmuls)
    f16 = np.asarray(score_tokens(_engine(hd32_path, "f16"), IDS))
    assert 0 < np.abs(a - f16).max() / np.abs(f16).max() < 0.02  # q8_0 rounds; not by much
    assert (a.argmax(-1) == f16.argmax(-1)).mean() > 0.9


def test_q8_0_refusals_are_one_line(tiny_model_path) -> None:
    with pytest.raises(
        ConfigError, match="q8_0 KV cache needs a head size divisible by 32 .this model has 16.$"
    ):
        _engine(tiny_model_path)  # head_dim 16, as llama.cpp refuses too


def test_torch_q8_0_cache_agrees_with_numpy(hd32_path) -> None:
    """The torch back end stores the same blocks (kv_q8.py) and reads them back as NumPy does."""
    pytest.importorskip("torch")
    torch_q8 = _engine(hd32_path, backend="torch", device="cpu")
    assert str(torch_q8.kv_cache.k.dtype) == "torch.int8" and torch_q8.kv_cache.k.shape[-1] == 34
    a = np.asarray(score_tokens(torch_q8, IDS))
    c = np.asarray(score_tokens(_engine(hd32_path, backend="numpy"), IDS))
    assert np.abs(a - c).max() / np.abs(c).max() < 1e-4


@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_rotates_a_q8_0_cache_as_numpy_does(tmp_path, head_dim: int) -> None:
    """Heads of 64 and 128 are stored rotated (kernels/kv_rotation.py): the torch back end rotates keys,
    values, queries and outputs the same way, so its scores and its cache's bytes are NumPy's."""
    pytest.importorskip("torch")
    shape = Shape(dim=4 * head_dim, heads=4, kv_heads=2, head_dim=head_dim)
    path = write_arch_model(tmp_path / f"qwen2-hd{head_dim}.gguf", "qwen2", n_layers=2, shape=shape)
    torch_q8, twin = _engine(path, backend="torch", device="cpu"), _engine(path, backend="numpy")
    a, c = (np.asarray(score_tokens(e, IDS)) for e in (torch_q8, twin))
    assert np.abs(a - c).max() / np.abs(c).max() < 1e-3  # unrotated: 6.4e-3; a few q8_0 rounding ties
    f16 = np.asarray(score_tokens(_engine(path, "f16", backend="numpy"), IDS))
    assert np.abs(c - f16).max() > 10 * np.abs(a - c).max()  # q8_0's own rounding, far above the gap
    blocks = len(IDS) // torch_q8.kv_cache.block_size  # full blocks: the prompt's, cached
    for pool_t, pool_n in ((torch_q8.kv_cache.k, twin.kv_cache.k), (torch_q8.kv_cache.v, twin.kv_cache.v)):
        t_rows, n_rows = pool_t.numpy()[:, :blocks], np.asarray(pool_n)[:, :blocks]
        assert (t_rows != n_rows).mean() < 0.01  # byte for byte up to float32 ties in the rounding


def test_a_restart_restores_a_q8_0_prefix_bit_for_bit(hd32_path, tmp_path) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    prompt = np.random.default_rng(2).integers(3, 250, 70).tolist()

    def run(disk: bool) -> tuple:
        e = _engine(hd32_path, kv_disk_mb=16 if disk else 0, kv_disk_dir=tmp_path, max_num_seqs=2)
        out = e.generate([prompt], params)[0]
        if disk:
            assert e.block_manager.tier.flush()
        return out.cached_tokens, [(t.token_id, t.logprob, t.top) for t in out.logprobs]

    cold = run(False)
    assert run(True) == cold
    cached, tokens = run(True)
    assert cached == 64 and tokens == cold[1]
    f16 = _engine(hd32_path, "f16", kv_disk_mb=16, kv_disk_dir=tmp_path)
    assert f16.generate([prompt], params)[0].cached_tokens == 0  # another fingerprint: never shared


def test_keys_and_values_of_different_types_run_in_the_fused_stack(hd32_path) -> None:
    """-ctk q8_0 -ctv f16 (and the reverse): the fused stack views K and V each in its own row width
    (it gave V the keys' width, and failed); it agrees with the NumPy back end."""
    for k, v in (("q8_0", "f16"), ("f16", "q8_0")):
        kw = {"cache_type_k": k, "cache_type_v": v}
        fused = LLMEngine(EngineConfig(model=str(hd32_path), threads=2, **kw))
        assert fused.backend.fused(fused.model)
        twin = LLMEngine(EngineConfig(model=str(hd32_path), backend="numpy", threads=1, **kw))
        a, c = (np.asarray(score_tokens(e, IDS)) for e in (fused, twin))
        assert np.abs(a - c).max() / np.abs(c).max() < 0.02, (k, v)
