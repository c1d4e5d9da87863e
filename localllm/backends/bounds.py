"""Bounds checks at the Numba kernels' Python entry points, once per call (microseconds).

The kernels index raw memory without checks (that is what makes them fast), so a shape or index that
disagrees with the arrays would write out of bounds. The loader validates files before this point;
these checks make sure a bug anywhere else becomes a clear exception, never heap corruption.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class KernelBoundsError(ValueError):
    """An input that would make a kernel read or write outside its arrays."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KernelBoundsError(what)


def check_same(shape: tuple, expected: tuple, what: str) -> None:
    _require(tuple(shape) == tuple(expected), f"{what}: shape {tuple(shape)}, expected {tuple(expected)}")


def _in_range(a: np.ndarray, lo: int, hi: int, what: str) -> None:
    """lo <= a < hi elementwise (empty arrays pass)."""
    if a.size:
        _require(int(a.min()) >= lo and int(a.max()) < hi, f"{what} outside [{lo}, {hi})")


def check_kv_write(kv_shapes: tuple, cache_shapes: tuple, slots: np.ndarray, positions: np.ndarray) -> None:
    """k and v (T, kv_heads, head_dim) into caches (blocks, block_size, kv_heads, head_dim) at slots."""
    (kv_shape, v_shape), (cache_shape, v_cache_shape) = kv_shapes, cache_shapes
    _require(kv_shape == v_shape and cache_shape == v_cache_shape, "k and v differ in shape")
    _require(
        len(cache_shape) == 4 and tuple(kv_shape[1:]) == tuple(cache_shape[2:]), "k/v do not fit the cache"
    )
    _require(slots.shape == positions.shape == (kv_shape[0],), "one slot and position per token")
    _in_range(slots, -1, cache_shape[0] * cache_shape[1], "slot_mapping")


def check_attention(q_shape: tuple, cache_shape: tuple, qsl: np.ndarray, ctx: np.ndarray,
                    tables: np.ndarray) -> None:  # fmt: skip
    """A mixed batch's queries (T, heads, head_dim), context lengths and block tables against the cache."""
    n_seqs, bs = ctx.shape[0], cache_shape[1]
    _require(len(q_shape) == 3 and q_shape[2] == cache_shape[3], "q head size differs from the cache's")
    _require(q_shape[1] % cache_shape[2] == 0, "query heads are not a multiple of KV heads")
    _require(qsl.shape == (n_seqs + 1,) and tables.ndim == 2 and tables.shape[0] == n_seqs, "batch shapes")
    if n_seqs == 0:
        return
    counts = np.diff(qsl)
    _require(int(qsl[0]) == 0 and int(qsl[-1]) == q_shape[0] and bool((counts >= 0).all()), "query_start_loc")
    _require(bool((ctx >= counts).all()) and int(ctx.max()) <= tables.shape[1] * bs, "context_lens")
    _in_range(tables, 0, cache_shape[0], "block_tables")


def check_step(args: Any, x: np.ndarray, batch: Any, k: np.ndarray, v: np.ndarray) -> None:
    """A fused step: x (T, dim), the batch's arrays and the whole KV pool against the model's dims (the
    pool's rows, ModelArgs.kv_row_shape; a narrower layer's view of them holds as many bytes)."""
    kv_heads, head_dim = args.kv_row_shape()
    shape = (args.n_layers, k.shape[1], k.shape[2], kv_heads, head_dim)
    _require(k.shape == v.shape == shape, "KV pool does not match the model")
    _require(x.ndim == 2 and x.shape[1] == args.dim, "hidden states do not match the model")
    t = x.shape[0]
    kv_shape = (t, kv_heads, head_dim)
    check_kv_write((kv_shape, kv_shape), (k.shape[1:], v.shape[1:]), batch.slot_mapping, batch.positions)
    q_shape = (t, args.n_heads, head_dim)
    check_attention(q_shape, k.shape[1:], batch.query_start_loc, batch.context_lens, batch.block_tables)
