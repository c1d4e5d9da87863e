"""Gemma 4 files shaped as the released ones (tests/support/tiny_gemma4.py) against llama.cpp.

Per-layer head sizes and KV head counts, KV sharing across layers, a per-layer FFN width and per-layer
inputs: localllm must agree with llama.cpp's fixture (tests/data/arch, fixtures/make_arch_fixtures.py)
as closely as its NumPy oracle does, fused and op by op, and dropping a feature must fail the check.
"""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_conforms_to_llama_cpp(path, backend: str) -> None:
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
