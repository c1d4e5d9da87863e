"""Gemma 4 files shaped as the released ones (tests/support/tiny_gemma4.py) against llama.cpp.

Per-layer head sizes and KV head counts, KV sharing across layers, a per-layer FFN width and per-layer
inputs: localllm must agree with llama.cpp's fixture (tests/data/arch, fixtures/make_arch_fixtures.py)
as closely as its NumPy oracle does, fused and op by op, and dropping a feature must fail the check.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from arch_conformance import (
    assert_fixture_file,
    engine,
    failures,
    greedy,
    greedy_problem,
    load_fixture,
    teacher_forced,
)
from tiny_gemma4 import GEMMA4_VARIANTS, write_gemma4_variant

VARIANT = "gemma4_e"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gemma4_variant(tmp_path_factory.mktemp("g4") / f"{VARIANT}.gguf", VARIANT)


def test_file_is_the_one_llama_cpp_ran(path) -> None:
    assert VARIANT in GEMMA4_VARIANTS
    assert_fixture_file(path, VARIANT)


def test_specs_read_from_the_file(path) -> None:
    a = engine(path).model.args
    assert [a.head_dim_of(il) for il in range(8)] == [16, 16, 16, 32] * 2
    assert [a.kv_heads_of(il) for il in range(8)] == [4, 4, 4, 1] * 2
    assert [s.kv_source for s in a.layers] == [-1, -1, -1, -1, 2, 2, 2, 3]
    assert [a.ffn_dim_of(il) for il in range(8)] == [96] * 4 + [192] * 4
    assert a.per_layer_dim == 8 and a.kv_row_shape() == (4, 16)
    assert [a.kv_block_factor(il) for il in range(4)] == [1, 1, 1, 2]


@pytest.mark.parametrize("backend", ["numba", "numpy", "torch"])
def test_conforms_to_llama_cpp(path, backend: str) -> None:
    """Every backend, torch's too (its attention once read a narrower layer's cache through the pool's
    block ids: logits 0.85 RMS off while the top-1 still agreed)."""
    if backend == "torch":
        pytest.importorskip("torch")
    ref = load_fixture(VARIANT)
    e = engine(path, backend)
    assert backend != "numba" or e.backend.fused(e.model), "should run fused"
    assert failures(teacher_forced(e, ref), ref) == []
    assert greedy_problem(greedy(e, ref), ref) is None


def test_fused_stack_agrees_with_the_op_path(path) -> None:
    ref = load_fixture(VARIANT)
    fused = teacher_forced(engine(path), ref)
    ops = teacher_forced(engine(path, fuse=False), ref)
    assert np.abs(fused - ops).max() / np.abs(ops).max() < 0.02
    assert (fused.argmax(-1) == ops.argmax(-1)).mean() > 0.95


def _no_per_layer_inputs(args):
    return {"per_layer_dim": 0}


@pytest.mark.parametrize("change", [_no_per_layer_inputs])
def test_the_fixture_discriminates(path, change) -> None:
    """Run without a feature, the same file fails the conformance check."""
    ref = load_fixture(VARIANT)
    e = engine(path, fuse=False)
    e.model.args = dataclasses.replace(e.model.args, **change(e.model.args))
    assert failures(teacher_forced(e, ref), ref) != []


def test_sharing_layers_attend_the_source_cache(path) -> None:
    """The KV-sharing layers read layers 2 and 3's caches: their own slabs stay empty (zeros)."""
    ref = load_fixture(VARIANT)
    e = engine(path, fuse=False)
    teacher_forced(e, ref)
    k = np.asarray(e.kv_cache.k)
    assert np.any(k[2] != 0) and np.any(k[3] != 0)
    assert not np.any(k[4:] != 0)


def _fake(meta: dict):
    from types import SimpleNamespace

    return SimpleNamespace(
        path=Path("g.gguf"), architecture="gemma4", tensors={},
        arch_get=lambda key, default=None: meta.get(key, default),
    )  # fmt: skip


def test_inconsistent_layouts_are_refused_by_name() -> None:
    from localllm.errors import ModelFormatError
    from localllm.models import gemma4
    from localllm.models.spec import Hyper

    h = Hyper(100, 64, 4, 4, 2, 32, 96, 1e-6, 512)
    swa = [True, True, False, True]
    meta = {"attention.key_length_swa": 16, "attention.value_length": 32, "attention.value_length_swa": 32}
    with pytest.raises(ModelFormatError, match="value_length"):
        gemma4._layer_sizes(_fake(meta), h, swa)
    with pytest.raises(ModelFormatError, match="head_count_kv' has 3 values for 4 layers"):
        gemma4._layer_sizes(_fake({"attention.head_count_kv": [2, 2, 1]}), h, swa)
    sizes = gemma4._layer_sizes(_fake({}), h, swa)
    # layer 3 (sliding) would reuse layer 1 (sliding): fine; with 3 shared, layer 1 has no full source
    assert gemma4._kv_sources(_fake({"attention.shared_kv_layers": 1}), 4, swa, sizes) == [-1, -1, -1, 1]
    with pytest.raises(ModelFormatError, match="shared_kv_layers' is 3 of 4"):
        gemma4._kv_sources(_fake({"attention.shared_kv_layers": 3}), 4, swa, sizes)
    with pytest.raises(ModelFormatError, match="another kind"):
        gemma4._kv_sources(_fake({"attention.shared_kv_layers": 1}), 4, [True, False, True, False], sizes)


def test_info_counts_the_kv_memory_the_engine_allocates(path) -> None:
    from localllm.model_info import summarize

    e = engine(path)
    info = summarize(e.gguf)
    assert (info.n_kv_heads, info.head_dim) == (4, 16)
    assert info.kv_bytes_per_token == e.kv_cache.layout.bytes_per_token == 2 * 8 * 64 * 2
