"""A whole stack of llama-style decoder layers in one compiled call.

The model code (localllm/models) runs a layer as ~12 backend operations, each a Python call into a
kernel: at decode time (one token) that glue cost about as much as the matmuls.  `decoder_stack`
runs the same kernels in the same order for every layer without returning to Python, so its
results are bit-identical to the operation-by-operation path (tests compare them).
Covers RMSNorm -> q/k/v (+ optional biases) -> RoPE + KV store -> paged attention -> output
projection -> residual -> RMSNorm -> gate/up -> SwiGLU -> down -> residual (llama, qwen2).

Per layer the weights come as launch tables (see matmul.launch_many): qkv (3, 5), o (1, 5),
gate/up (2, 5), down (1, 5), stacked over layers.
Like the other entry points called from Python it releases the GIL (nogil), so a server's HTTP
thread keeps streaming while a step computes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import attention, layers, matmul

# Attention below this many multiply-adds runs on one thread (a parallel launch costs ~5 us).
ATTN_PARALLEL_MIN = 1 << 15


@njit(cache=True)
def _project(table, gemm, quantize, x, outs, nth):
    """x @ W.T for each weight of `table` into the C-contiguous arrays of the tuple `outs`."""
    dest = np.empty((len(outs), 2), np.int64)
    for i in range(len(outs)):
        dest[i, 0], dest[i, 1] = outs[i].ctypes.data, outs[i].size // outs[i].shape[0]
    matmul.launch_many(table, gemm, quantize, x, dest, nth)


@njit(cache=True)
def _add_rows(x, y) -> None:
    """x += y: the residual add."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] + y[t, j]


@njit(cache=True)
def _add_bias(x, bias) -> None:
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] + bias[j]


@njit(cache=True)
def _attend(q, k_cache, v_cache, qsl, ctx, tables, scale, out, nth) -> None:
    work = q.shape[0] * q.shape[1] * q.shape[2] * (ctx.max() if ctx.size else 0)
    if nth > 1 and work >= ATTN_PARALLEL_MIN:
        attention.paged_attention_par(q, k_cache, v_cache, qsl, ctx, tables, scale, 0, out, nth)
    else:
        attention.paged_attention_serial(q, k_cache, v_cache, qsl, ctx, tables, scale, 0, out)


@njit(cache=True)
def _attention_block(il, x, w, shape, batch, kv, bufs, nth):
    """x += o_proj(attention(rope(q, k), v)) of rms_norm(x), k/v stored in the cache."""
    t_qkv, t_o, gemm, quantize, attn_norm, biases, has_bias = w
    nq, nkv, hd, rope_dim, rope_base, neox, eps, scale = shape
    pos, slots, qsl, ctx, block_tables, rope_table = batch
    h, q, k, v, att, o, _, _, _, _ = bufs
    layers.rms_norm_rows(x, attn_norm[il], eps, h)
    _project(t_qkv[il], gemm, quantize, h, (q, k, v), nth)
    if has_bias:
        _add_bias(q.reshape(q.shape[0], -1), biases[0][il])
        _add_bias(k.reshape(k.shape[0], -1), biases[1][il])
        _add_bias(v.reshape(v.shape[0], -1), biases[2][il])
    k_cache, v_cache = kv[0][il], kv[1][il]
    layers.rope_store_kv(q, k, v, pos, rope_dim, rope_base, neox, rope_table, k_cache, v_cache, slots, q, k)
    _attend(q, k_cache, v_cache, qsl, ctx, block_tables, scale, att, nth)
    _project(t_o[il], gemm, quantize, att.reshape(att.shape[0], -1), (o,), nth)
    _add_rows(x, o)


@njit(cache=True)
def _ffn_block(il, x, w, eps, bufs, nth):
    """x += down(silu(gate(h)) * up(h)), h = rms_norm(x)."""
    t_gu, t_down, gemm, quantize, ffn_norm = w
    h, _, _, _, _, o, gate, up, act, down = bufs
    layers.rms_norm_rows(x, ffn_norm[il], eps, h)
    _project(t_gu[il], gemm, quantize, h, (gate, up), nth)
    layers.swiglu_rows(gate, up, act)
    _project(t_down[il], gemm, quantize, act, (down,), nth)
    _add_rows(x, down)


@njit(cache=True)
def _buffers(T, d, nq, nkv, hd, ffn):
    f = np.float32
    return (
        np.empty((T, d), f),
        np.empty((T, nq, hd), f),
        np.empty((T, nkv, hd), f),
        np.empty((T, nkv, hd), f),
        np.empty((T, nq, hd), f),
        np.empty((T, d), f),
        np.empty((T, ffn), f),
        np.empty((T, ffn), f),
        np.empty((T, ffn), f),
        np.empty((T, d), f),
    )


@njit(cache=True, nogil=True)
def decoder_stack(x, attn_w, ffn_w, shape, batch, kv, ffn_dim, nth):
    """Run every layer on x (T, d) in place.  attn_w = (qkv tables, o tables, gemm, quantize,
    attn_norm (L, d), (bq, bk, bv) (L, n) each, has_bias); ffn_w = (gate/up tables, down tables,
    gemm, quantize, ffn_norm (L, d)); shape = (n_heads, n_kv_heads, head_dim, rope_dim, rope_base,
    neox, eps, attn_scale); batch = (positions, slot_mapping, query_start_loc, context_lens,
    block_tables, rope table); kv = (k cache, v cache) (L, blocks, block_size, kv_heads, head_dim)."""
    nq, nkv, hd = shape[0], shape[1], shape[2]
    bufs = _buffers(x.shape[0], x.shape[1], nq, nkv, hd, ffn_dim)
    for il in range(attn_w[4].shape[0]):
        _attention_block(il, x, attn_w, shape, batch, kv, bufs, nth)
        _ffn_block(il, x, ffn_w, shape[6], bufs, nth)
    # keep the buffers alive past the kernels that only saw their addresses
    return (
        bufs[1].size + bufs[2].size + bufs[3].size + bufs[5].size + bufs[6].size + bufs[7].size + bufs[9].size
    )
