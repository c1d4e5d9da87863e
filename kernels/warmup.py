"""Compile (or load from Numba's on-disk cache) every kernel specialisation a model step uses.

Each kernel is called once on tiny inputs of exactly the dtypes/ranks the backend passes, so the
first real step finds everything compiled.  Per-weight-type matmul kernels are compiled when a
weight is prepared; the launchers that call them are the same for every type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import attention, layers, matmul
from .packing import Q8_0, TILE_ROWS


def warm_kernels(
    weights: list[Any], threads: int, layer_ops: bool = True, kv_dtypes: tuple = (np.float32, np.float32)
) -> None:
    """layer_ops=False: only what a step uses around a fused layer stack (embedding, final norm, output
    projection); the stack itself is one kernel, loaded at its first call.  Each kernel loaded from
    Numba's cache adds to start-up, so a fused model skips the op-by-op layer kernels.
    kv_dtypes: the K and V caches' storage types (float32, uint16 for f16, int8 for q8_0)."""
    _warm_matmul(weights, threads, layer_ops)
    x = np.ones((2, 64), np.float32)
    layers.rms_norm_rows(x, np.ones(64, np.float32), 1e-5, np.empty_like(x))
    if not layer_ops:
        return
    layers.swiglu_rows(x, x, np.empty_like(x))
    layers.geglu_rows(x, x, np.empty_like(x))
    kc, vc = (_cache((2, 4, 2), 32, t) for t in kv_dtypes)
    qk, pos = x.reshape(2, 2, 32), np.arange(2, dtype=np.int64)
    cos, sin = np.empty((2, 16), np.float32), np.empty((2, 16), np.float32)
    layers.rope_rows(pos, np.ones(16), 1.0, np.full(2, -1, np.int64), cos, sin)
    layers.rope_store_kv(qk, qk, qk, cos, sin, 32, False, kc, vc, pos, np.empty_like(qk), np.empty_like(qk))
    _warm_attention(threads, kv_dtypes)


def _cache(shape: tuple, head_dim: int, dtype: Any) -> np.ndarray:
    """A zeroed cache of head_dim-wide rows in a storage type (q8_0's int8 rows hold 34 bytes per 32)."""
    width = head_dim // 32 * 34 if np.dtype(dtype) == np.int8 else head_dim
    return np.zeros((*shape, width), dtype)


def _warm_matmul(weights: list[Any], threads: int, grouped: bool) -> None:
    """The launchers, on both paths: their code does not depend on the weight's type or on T.  Each
    path runs with a weight that needs that path's per-type kernel anyway (loading another would add
    to start-up): the first prepared one (the token embedding) on the float path, which does
    its row lookups, and the last quantized one (a layer matrix) on the integer path."""
    if not weights:
        weights = [matmul.prepare_weight(np.zeros((TILE_ROWS, 32), np.float32), 0)]  # F32: float only
    wf = weights[0]
    wi = next((w for w in reversed(weights) if w.lane), None)
    # a quantized embedding never multiplies on the float path (with AVX2): no GEMM to load for it
    float_weight = None if (wf.lane and matmul.INT_PATH_MAX_T > 1 << 20) else wf
    for w, use_int in ((float_weight, False), (wi, True)):
        if w is None:
            continue
        x, y = np.zeros((2, w.k), np.float32), np.empty((2, w.n), np.float32)
        fn = w.kernels[0] if use_int else w.kernels[1]
        gemm = 0 if use_int else w.gemm
        rounding = matmul.rounding_of(w.kind) if use_int else matmul.ROUND_NONE
        matmul.launch_linear_serial(fn, gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y)
        matmul.launch_linear(fn, gemm, rounding, w.addr, w.nbytes, w.n, w.k, x, y, threads)
    matmul.embedding(wf, np.zeros(1, np.int64))
    q8 = [v for v in weights if v.kind == Q8_0]
    if q8:  # the int16-activation path of linear_precise: both launchers (which runs depends on the size
        # and the step's thread count: a restarted server's first prefill loaded the serial one)
        w = q8[0]
        x, y = np.zeros((1, w.k), np.float32), np.empty((1, w.n), np.float32)
        fn = matmul.range_kernel(Q8_0, "int16").address
        matmul.launch_linear16_serial(fn, w.addr, w.nbytes, w.n, w.k, x, y)
        matmul.launch_linear16(fn, w.addr, w.nbytes, w.n, w.k, x, y, threads)
    w2 = next((v for v in weights if v.lane and v.kind != Q8_0), None)
    if w2 is not None:  # the two-pass path of linear_precise (an output projection's)
        matmul.linear_precise(np.zeros((1, w2.k), np.float32), w2, threads)
    if grouped:
        w = wi or wf
        matmul.linear_group(np.zeros((2, w.k), np.float32), matmul.WeightGroup.of((w, w)), threads)


def _warm_attention(threads: int, kv_dtypes: tuple) -> None:
    # (blocks, block_size, kv_heads, head_dim): 32 wide, a q8_0 block
    k_cache, v_cache = (_cache((2, 4, 1), 32, t) for t in kv_dtypes)
    q = np.ones((2, 2, 32), np.float32)
    qsl, ctx = np.array([0, 2], np.int64), np.array([2], np.int64)
    tables = np.zeros((1, 2), np.int64)
    kv = np.ones((2, 1, 32), np.float32)
    layers.store_kv_rows(k_cache, v_cache, kv, kv, np.arange(2, dtype=np.int64))
    args = (q, k_cache, v_cache, qsl, ctx, tables, 1.0, 0, 0.0, np.empty_like(q))
    attention.paged_attention_serial(*args)
    attention.paged_attention_par(*args, threads)
