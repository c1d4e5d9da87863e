"""Bounds checks at the Numba kernels' Python entry points, once per call (microseconds).

The kernels index raw memory without checks (that is what makes them fast), so a shape or index that
disagrees with the arrays would write out of bounds. The loader validates files before this point;
these checks make sure a bug anywhere else becomes a clear exception, never heap corruption.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from localllm.backends.kv_types import Q8_0_VALUES, row_width
from localllm.kernels.batch_bounds import batch_arrays_ok


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


def cache_width(head_dim: int, dtype: Any) -> int:
    """The last axis of a cache of head_dim-wide rows: head_dim, or a q8_0 row's bytes (int8 pools)."""
    if np.dtype(dtype) != np.int8:
        return head_dim
    _require(head_dim % Q8_0_VALUES == 0, f"q8_0 rows need a head size divisible by 32, not {head_dim}")
    return row_width("q8_0", head_dim)


def check_kv_write(kv_shapes: tuple, caches: tuple, slots: np.ndarray, positions: np.ndarray) -> None:
    """k and v (T, kv_heads, head_dim) into caches (blocks, block_size, kv_heads, width) at slots."""
    (kv_shape, v_shape), (k_cache, v_cache) = kv_shapes, caches
    _require(kv_shape == v_shape and k_cache.shape[:-1] == v_cache.shape[:-1], "k and v differ in shape")
    for cache in caches:
        shape, width = cache.shape, cache_width(kv_shape[2], cache.dtype)
        fits = len(shape) == 4 and kv_shape[1] == shape[2] and shape[3] == width
        _require(fits, "k/v do not fit the cache")
    _require(slots.shape == positions.shape == (kv_shape[0],), "one slot and position per token")
    _in_range(slots, -1, k_cache.shape[0] * k_cache.shape[1], "slot_mapping")


def check_attention(q_shape: tuple, caches: tuple, qsl: np.ndarray, ctx: np.ndarray,
                    tables: np.ndarray) -> None:  # fmt: skip
    """A mixed batch's queries (T, heads, head_dim), context lengths and block tables against the
    (k, v) caches."""
    cache_shape, n_seqs = caches[0].shape, ctx.shape[0]
    bs = cache_shape[1]
    _require(len(q_shape) == 3 and len(cache_shape) == 4, "q or cache rank")
    for cache in caches:
        same = cache.shape[:3] == cache_shape[:3] and cache.shape[3] == cache_width(q_shape[2], cache.dtype)
        _require(same, "q head size differs from the cache's")
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
    pool's rows, ModelArgs.kv_row_shape; a narrower layer's view of them holds as many bytes). A pool
    already found to fit skips its shape checks, and the batch arrays go through one compiled pass
    (kernels/batch_bounds.py); the checks below name whatever that pass refuses."""
    kv_heads, head_dim = _row_shape(args)
    shape = (args.n_layers, k.shape[1], k.shape[2], kv_heads)
    _require(k.shape[:4] == v.shape[:4] == shape, "KV pool does not match the model")
    _require(x.ndim == 2 and x.shape[1] == args.dim, "hidden states do not match the model")
    pool = (k.shape, v.shape, k.dtype, v.dtype, args.n_heads, head_dim)
    if pool in _FITTING_POOLS and _arrays_ok(batch, x.shape[0], k.shape):
        return
    _check_step_arrays(args, x.shape[0], batch, k, v, kv_heads, head_dim)
    _FITTING_POOLS.add(pool)
    _require(_arrays_ok(batch, x.shape[0], k.shape), "batch arrays out of bounds")


def _row_shape(args: Any) -> tuple[int, int]:
    """args.kv_row_shape(), remembered per (frozen) ModelArgs: a pass over every layer's spec each step."""
    hit = _ROW_SHAPES.get(id(args))
    if hit is None or hit[0] is not args:
        if len(_ROW_SHAPES) >= 64:  # models come and go in a server: keep a handful
            _ROW_SHAPES.clear()
        hit = _ROW_SHAPES[id(args)] = (args, args.kv_row_shape())
    return hit[1]


_ROW_SHAPES: dict[int, tuple[Any, tuple[int, int]]] = {}
# (shapes, dtypes, heads, head size) of KV pools check_step found to fit its model (a handful a process)
_FITTING_POOLS: set[tuple] = set()


def _arrays_ok(batch: Any, t: int, pool_shape: tuple) -> bool:
    """batch_arrays_ok for 1-D slots/positions/query starts/context lengths and 2-D block tables."""
    slots, pos, qsl, ctx, tables = (batch.slot_mapping, batch.positions, batch.query_start_loc,
                                    batch.context_lens, batch.block_tables)  # fmt: skip
    if not (slots.ndim == pos.ndim == qsl.ndim == ctx.ndim == 1 and tables.ndim == 2):
        return False
    blocks, bs = pool_shape[1], pool_shape[2]
    return batch_arrays_ok(slots, pos, qsl, ctx, tables, t, blocks * bs, bs, blocks)


def _check_step_arrays(args: Any, t: int, batch: Any, k: np.ndarray, v: np.ndarray, kv_heads: int,
                       head_dim: int) -> None:  # fmt: skip
    """check_step's checks of the pool's layer-0 caches and the batch's arrays, each named."""
    kv_shape = (t, kv_heads, head_dim)
    check_kv_write((kv_shape, kv_shape), (k[0], v[0]), batch.slot_mapping, batch.positions)
    q_shape = (t, args.n_heads, head_dim)
    check_attention(q_shape, (k[0], v[0]), batch.query_start_loc, batch.context_lens, batch.block_tables)


def check_gated_delta(qkv_shape: tuple, spec: Any, batch: Any, conv_shape: tuple, ssm_shape: tuple) -> None:
    """A Gated DeltaNet step: the conv input (T, channels), the batch's state slots and query starts
    against a layer's state pool, conv (slots, taps-1, channels) and ssm (slots, Hv, Dv, Dk)."""
    d, n_v = spec.ssm_head_dim, spec.ssm_v_heads
    channels = (2 * spec.ssm_k_heads + n_v) * d
    _require(qkv_shape[1:] == (channels,), "the conv input does not match the layer")
    _require(tuple(conv_shape[1:]) == (spec.ssm_conv - 1, channels), "conv state does not match the layer")
    _require(tuple(ssm_shape[1:]) == (n_v, d, d) and conv_shape[0] == ssm_shape[0], "ssm state shape")
    slots, qsl = batch.state_slots, batch.query_start_loc
    _require(slots is not None and qsl.shape == (slots.shape[0] + 1,), "one state slot per sequence")
    _require(int(qsl[0]) == 0 and int(qsl[-1]) == qkv_shape[0] and bool((np.diff(qsl) >= 0).all()), "qsl")
    _require(batch.positions.shape == (qkv_shape[0],), "one position per token")
    counts = np.diff(qsl)
    _in_range(slots[counts > 0], 0, ssm_shape[0], "state_slots")
