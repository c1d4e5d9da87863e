"""kernels/batch_bounds.batch_arrays_ok against its NumPy twin (backends/bounds.check_kv_write and
check_attention's array checks) on valid batches and on each kind of bad one, and check_step's fast path
still naming what it refuses; matmul.embedding's id range check, short and long."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from random_weights import random_weight

from localllm.backends import bounds
from localllm.kernels import matmul
from localllm.kernels.batch_bounds import batch_arrays_ok

BLOCKS, BS, KVH, HD, HEADS = 6, 4, 2, 8, 4


def _batch(rng: np.random.Generator) -> SimpleNamespace:
    """A random valid mixed batch: 1-3 sequences, each some new tokens at the end of its context."""
    n = int(rng.integers(1, 4))
    counts = rng.integers(1, 5, n)
    ctx = counts + rng.integers(0, 8, n)
    width = int(-(-ctx.max() // BS))
    tables = rng.integers(0, BLOCKS, (n, width))
    qsl = np.concatenate([[0], np.cumsum(counts)])
    slots = rng.integers(-1, BLOCKS * BS, int(qsl[-1]))
    return SimpleNamespace(slot_mapping=slots, positions=np.arange(slots.size), query_start_loc=qsl,
                           context_lens=ctx, block_tables=tables)  # fmt: skip


def _numpy_ok(b: SimpleNamespace, caches: tuple) -> bool:
    t = b.slot_mapping.shape[0] if b.positions.shape == b.slot_mapping.shape else -1
    try:
        bounds.check_kv_write(((t, KVH, HD), (t, KVH, HD)), caches, b.slot_mapping, b.positions)
        bounds.check_attention((t, HEADS, HD), caches, b.query_start_loc, b.context_lens, b.block_tables)
    except bounds.KernelBoundsError:
        return False
    return True


def _kernel_ok(b: SimpleNamespace) -> bool:
    t = b.slot_mapping.shape[0]
    return batch_arrays_ok(b.slot_mapping, b.positions, b.query_start_loc, b.context_lens, b.block_tables,
                           t, BLOCKS * BS, BS, BLOCKS)  # fmt: skip


def _spoil(b: SimpleNamespace, how: int, rng: np.random.Generator) -> None:
    """One kind of out-of-range entry or inconsistency."""
    if how == 0:
        b.slot_mapping[rng.integers(b.slot_mapping.size)] = BLOCKS * BS + int(rng.integers(0, 3))
    elif how == 1:
        b.slot_mapping[0] = -2
    elif how == 2:
        b.block_tables[rng.integers(b.block_tables.shape[0]), 0] = BLOCKS
    elif how == 3:
        b.block_tables[0, -1] = -1
    elif how == 4:
        b.context_lens[rng.integers(b.context_lens.size)] = b.block_tables.shape[1] * BS + 1
    elif how == 5:
        b.context_lens[0] = 0  # fewer than its new tokens
    elif how == 6:
        b.query_start_loc[-1] += 1
    elif how == 7:
        b.query_start_loc[0] = 1
    elif how == 8:
        b.positions = b.positions[:-1]
    elif how == 9:
        b.query_start_loc = b.query_start_loc[:-1]


@pytest.mark.parametrize("seed", range(40))
def test_kernel_agrees_with_numpy_checks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    caches = (np.zeros((BLOCKS, BS, KVH, HD), np.float32),) * 2
    b = _batch(rng)
    assert _kernel_ok(b) and _numpy_ok(b, caches)
    for how in range(10):
        bad = _batch(np.random.default_rng(seed))
        _spoil(bad, how, rng)
        assert _kernel_ok(bad) == _numpy_ok(bad, caches), how
        assert not _kernel_ok(bad), how


def test_empty_batch_passes_both() -> None:
    e = np.zeros(0, np.int64)
    b = SimpleNamespace(slot_mapping=e, positions=e, query_start_loc=np.zeros(1, np.int64), context_lens=e,
                        block_tables=np.zeros((0, 1), np.int64))  # fmt: skip
    caches = (np.zeros((BLOCKS, BS, KVH, HD), np.float32),) * 2
    assert _kernel_ok(b) and _numpy_ok(b, caches)


def test_check_step_names_a_bad_block_table_on_the_fast_path() -> None:
    """A pool already seen fitting takes the compiled pass; a bad entry still raises the named error."""
    args = SimpleNamespace(n_layers=1, n_heads=HEADS, dim=16, kv_row_shape=lambda: (KVH, HD))
    k = np.zeros((1, BLOCKS, BS, KVH, HD), np.float32)
    b = _batch(np.random.default_rng(1))
    x = np.zeros((b.slot_mapping.size, 16), np.float32)
    bounds.check_step(args, x, b, k, k.copy())  # first: the full checks, remembering the pool
    bounds.check_step(args, x, b, k, k.copy())
    b.block_tables[0, 0] = BLOCKS
    with pytest.raises(bounds.KernelBoundsError, match="block_tables"):
        bounds.check_step(args, x, b, k, k.copy())


@pytest.mark.parametrize("n_ids", [1, 3, 65, 200])
def test_embedding_refuses_ids_outside_the_vocabulary(n_ids: int) -> None:
    """Few ids (a decode step's) are range-checked by Python's min/max, many by NumPy: both refuse."""
    w = matmul.prepare_weight(
        random_weight(np.random.default_rng(0), "Q8_0", 40, 64), gguf.GGMLQuantizationType.Q8_0
    )
    ids = np.arange(n_ids, dtype=np.int64) % 40
    assert matmul.embedding(w, ids).shape == (n_ids, 64)
    for bad in (40, -1):
        spoiled = ids.copy()
        spoiled[n_ids // 2] = bad
        with pytest.raises(IndexError, match="token id out of range"):
            matmul.embedding(w, spoiled)
    assert matmul.embedding(w, np.zeros(0, np.int64)).shape == (0, 64)
