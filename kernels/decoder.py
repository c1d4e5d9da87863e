"""A model's whole stack of decoder layers in one compiled call, executing each layer's LayerSpec.

The model code (localllm/models/layers.py) runs a layer as ~12-20 backend operations, each a Python
call into a kernel: at decode time (one token) that glue cost about as much as the matmuls.
`decoder_stack` runs the same kernels in the same order for every layer without returning to Python.
Per layer, as its spec says: RMSNorm -> q/k/v (+ biases) -> q/k RMSNorm -> RoPE (the layer's own
base and scaling) + KV store -> paged attention (the layer's window and soft-cap) -> output
projection -> post-norm -> residual -> RMSNorm -> gate/up -> SwiGLU or GeGLU -> down (8-bit, or
near-float activations), or the routed experts (kernels/moe.py) plus a sigmoid-gated shared expert ->
post-norm -> residual.

Inputs are named tuples (StackWeights, Dims, Step) and an int64 (layers, N_FLAGS) array of per-layer
switches whose columns are named below, so no caller indexes a positional tuple. Launch tables are
(layers, weights, 6) rows of matmul.launch_many. Like the other entry points called from Python it
releases the GIL (nogil), so a server's HTTP thread keeps streaming while a step computes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from . import attention, layers, matmul, moe
from .quantize_act import with_residual

# Attention below this many multiply-adds runs on one thread (a parallel launch costs more than it saves).
ATTN_PARALLEL_MIN = 1 << 15

# Columns of the per-layer flags array.
F_WINDOW = 0  # sliding window (0: whole context)
F_GELU = 1  # 1: GeGLU (tanh-GELU gate), 0: SwiGLU
F_BIAS = 2  # q/k/v biases
F_QK_NORM = 3  # RMSNorm over each head of q and k
F_POST_ATTN = 4  # RMSNorm of the attention output before the residual add
F_POST_FFN = 5  # the same for the feed-forward
F_DOWN = 6  # DOWN_* below
F_ROPE = 7  # index of the layer's rotation in Step.cos / Step.sin
F_EXPERTS = 8  # experts used per token (0: the dense FFN only)
F_RENORM = 9  # renormalise the routed experts' weights
F_SHARED = 10  # the dense FFN runs too, as a shared expert under a sigmoid gate
F_SINKS = 11  # attention sinks (Extras.sinks)
F_O_BIAS = 12  # output projection bias (Extras.bo)
F_EXPERT_BIAS = 13  # router and expert biases (Extras.router_b, *_exps_b)
F_OAI = 14  # gpt-oss's clamped SwiGLU for the experts and the dense FFN
F_V_NORM = 15  # RMSNorm over each head of v (weights StackWeights.v_norm)
F_HEAD_DIM = 16  # the layer's own head width, KV heads and FFN width (at most Dims', which size buffers)
F_KV_HEADS = 17
F_FFN = 18
F_KV_LAYER = 19  # the layer whose cache it attends (itself, or an earlier one: it then stores no K/V)
F_KV_FACTOR = 20  # its blocks per pool block (KVCache.layer: pool rows / its rows)
F_PER_LAYER = 21  # adds its per-layer input (Step.per_layer, StackWeights.ple_*)
F_PARALLEL = 22  # gemma4: the dense FFN beside the experts, each normed (Extras.ffn_norm_2 ... router_norm)
F_EXPERT_SCALE = 23  # each expert's down output times its Extras.down_exps_s entry
N_FLAGS = 24

DOWN_PLAIN, DOWN_INT16, DOWN_TWO_PASS = 0, 1, 2  # how the down projection rounds its activations


class StackWeights(NamedTuple):
    qkv: np.ndarray  # (L, 3, 6) launch tables
    o: np.ndarray  # (L, 1, 6)
    gate_up: np.ndarray  # (L, 2, 6)
    down: np.ndarray  # (L, 1, 6)
    down16: np.ndarray  # (L, 5): int16-activation table of a Q8_0 down projection (DOWN_INT16)
    attn_norm: np.ndarray  # (L, dim)
    ffn_norm: np.ndarray  # (L, dim)
    post_attn_norm: np.ndarray  # (L, dim), zeros where a layer has none
    post_ffn_norm: np.ndarray  # (L, dim)
    q_norm: np.ndarray  # (L, head_dim)
    k_norm: np.ndarray  # (L, head_dim)
    bq: np.ndarray  # (L, n_heads * head_dim)
    bk: np.ndarray  # (L, n_kv_heads * head_dim)
    bv: np.ndarray  # (L, n_kv_heads * head_dim)
    flags: np.ndarray  # (L, N_FLAGS) int64
    softcap: np.ndarray  # (L,) float32 attention soft-cap, 0 = off
    gemm: int  # the float GEMM's address (float path), else 0
    quantize: bool  # integer path: quantize activations to 8 bits
    router: np.ndarray  # (L, 1, 6) launch tables of the (experts, dim) routers (zeros: dense layers)
    gate_exps: np.ndarray  # (L, experts, 6): one row per expert
    up_exps: np.ndarray
    down_exps: np.ndarray
    shexp_gate: np.ndarray  # (L, dim) the shared expert's gate vector
    moe_stats: np.ndarray  # (2,) int64 counters, see moe.STAT_BYTES
    attn_temp: np.ndarray  # (L, 2) float64: attention temperature scale (0: off) and length
    v_norm: np.ndarray  # (L, head_dim): v's norm weights (F_V_NORM)
    out_scale: np.ndarray  # (L,) float32: the layer's output times this (1: none)
    extras: Extras
    ple_gate: np.ndarray  # (L, 1, 6) launch tables of the per-layer input's gate (F_PER_LAYER)
    ple_proj: np.ndarray  # (L, 1, 6) and of its projection back to dim
    ple_norm: np.ndarray  # (L, dim)


class Extras(NamedTuple):
    """Per-layer arrays of the rarer features (gpt-oss); 0-wide where no layer has one."""

    sinks: np.ndarray  # (L, n_heads) attention-sink logits
    bo: np.ndarray  # (L, dim)
    router_b: np.ndarray  # (L, experts)
    gate_exps_b: np.ndarray  # (L, experts, expert_ffn)
    up_exps_b: np.ndarray
    down_exps_b: np.ndarray  # (L, experts, dim)
    # gemma4's parallel experts (F_PARALLEL): (L, dim) norm weights, and (L, experts) down scales
    ffn_norm_2: np.ndarray
    post_ffn_norm_1: np.ndarray
    post_ffn_norm_2: np.ndarray
    router_norm: np.ndarray
    down_exps_s: np.ndarray


class Dims(NamedTuple):
    """The model's sizes; head_dim, n_kv_heads and ffn_dim are the largest of any layer's."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    eps: float
    attn_scale: float
    two_pass: bool  # some layer's down projection takes two 8-bit passes (needs 2T-row buffers)


class Step(NamedTuple):
    positions: np.ndarray  # (T,) int64
    slots: np.ndarray  # (T,) int64 slot_mapping
    qsl: np.ndarray  # (S + 1,) query_start_loc
    ctx: np.ndarray  # (S,) context_lens
    block_tables: np.ndarray  # (S, max_blocks)
    rope_dims: np.ndarray  # (R, 2) int64: rotated dims, neox
    rope_freqs: np.ndarray  # (R, max half) float64: per-pair speeds (RopeSpec.frequencies), 0-padded
    rope_mscale: np.ndarray  # (R,) float64: cos/sin magnitude (RopeSpec.mscale)
    per_layer: np.ndarray  # (L, T, P) float32 per-layer inputs (F_PER_LAYER), (L, 0, 0) without


class Buffers(NamedTuple):
    """One layer's views of the step's scratch: q/k/v/att and the FFN's in the layer's own sizes."""

    h: np.ndarray  # (T, dim) normalised input
    q: np.ndarray  # (T, n_heads, head_dim)
    k: np.ndarray  # (T, n_kv_heads, head_dim)
    v: np.ndarray
    kn: np.ndarray  # normalised k before rotation
    att: np.ndarray  # (T, n_heads, head_dim)
    o: np.ndarray  # (T, dim)
    gate: np.ndarray  # (T, ffn)
    up: np.ndarray
    act: np.ndarray
    down: np.ndarray  # (T, dim)
    act2: np.ndarray  # (2T, ffn) for DOWN_TWO_PASS, else empty
    down2: np.ndarray  # (2T, dim)
    cos: np.ndarray  # (R, T, max half)
    sin: np.ndarray


@njit(cache=True)
def _arena_sizes(T, d, dims):
    """Floats of q, k, v, kn, att, gate, up, act and down (flat, at the largest layer's sizes): they lie
    in that order in one arena, which hybrid_decoder's recurrent layers reuse (they touch none of them)."""
    nq, nkv, hd, ffn = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.ffn_dim
    return np.array((nq * hd, nkv * hd, nkv * hd, nkv * hd, nq * hd, ffn, ffn, ffn, d), np.int64) * T


@njit(cache=True)
def _buffers(T, d, dims, n_ropes, half):
    """The step's scratch at the largest layer's sizes (q, k, v, kn, att, gate, up, act, act2 flat)."""
    return _buffers_in(np.empty(_arena_sizes(T, d, dims).sum(), np.float32), T, d, dims, n_ropes, half)


@njit(cache=True)
def _buffers_in(arena, T, d, dims, n_ropes, half):
    """_buffers with q .. down in `arena` (at least _arena_sizes' sum of floats)."""
    f, ffn = np.float32, dims.ffn_dim
    t2 = 2 * T if dims.two_pass else 0
    sizes = _arena_sizes(T, d, dims)
    ends = np.cumsum(sizes)

    def part(i):
        return arena[ends[i] - sizes[i] : ends[i]]

    def flat3(i):
        return part(i).reshape((sizes[i], 1, 1))

    def flat2(i):
        return part(i).reshape((sizes[i], 1))

    return Buffers(
        np.empty((T, d), f), flat3(0), flat3(1), flat3(2), flat3(3), flat3(4),
        np.empty((T, d), f), flat2(5), flat2(6), flat2(7), part(8).reshape((T, d)),
        np.empty((t2 * ffn, 1), f), np.empty((t2, d), f),
        np.empty((n_ropes, T, half), f), np.empty((n_ropes, T, half), f),
    )  # fmt: skip


@njit(cache=True)
def _views(s, il, w, dims):
    """Layer il's Buffers: the scratch `s` (_buffers) reshaped to its own head and FFN sizes."""
    T, nq = s.h.shape[0], dims.n_heads
    hd, nkv, ffn = w.flags[il, F_HEAD_DIM], w.flags[il, F_KV_HEADS], w.flags[il, F_FFN]

    def heads(a, n):
        return a.reshape(-1)[: T * n * hd].reshape((T, n, hd))

    def rows(a, t):
        return a.reshape(-1)[: t * ffn].reshape((t, ffn))

    return Buffers(
        s.h, heads(s.q, nq), heads(s.k, nkv), heads(s.v, nkv), heads(s.kn, nkv), heads(s.att, nq), s.o,
        rows(s.gate, T), rows(s.up, T), rows(s.act, T), s.down, rows(s.act2, s.down2.shape[0]), s.down2,
        s.cos, s.sin,
    )  # fmt: skip


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
def _scale_rows(x, s) -> None:
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] * s


@njit(cache=True)
def _add_bias(x, bias) -> None:
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] + bias[j]


@njit(cache=True)
def _heads_norm(x, weight, eps, out) -> None:
    """RMSNorm over each head of x (T, heads, head_dim) into out."""
    layers.rms_norm_rows(x.reshape(-1, x.shape[2]), weight, eps, out.reshape(-1, x.shape[2]))


@njit(cache=True)
def _attend(q, k_cache, v_cache, step, tables, scale, window, softcap, sinks, out, nth) -> None:
    ctx = step.ctx
    work = q.shape[0] * q.shape[1] * q.shape[2] * (ctx.max() if ctx.size else 0)
    args = (q, k_cache, v_cache, step.qsl, ctx, tables, scale, window, softcap, sinks, out)
    if nth > 1 and work >= ATTN_PARALLEL_MIN:
        attention.paged_attention_sinks_par(*args, nth)
    else:
        attention.paged_attention_sinks_serial(*args)


@njit(cache=True)
def _layer_cache(il, w, step, kv):
    """The K/V cache layer il attends, in its own sizes, and the step's slots and block tables in its
    blocks (pool block b is its block b * factor: see KVCache.layer)."""
    src, f = w.flags[il, F_KV_LAYER], w.flags[il, F_KV_FACTOR]
    kc, vc = kv[0][src], kv[1][src]
    kvh = w.flags[il, F_KV_HEADS]
    # each its head_dim, or a q8_0 row's bytes (K and V may differ in type: -ctk q8_0 -ctv f16)
    k_shape = (kc.shape[0] * f, kc.shape[1], kvh, kc.shape[2] * kc.shape[3] // (f * kvh))
    v_shape = (vc.shape[0] * f, vc.shape[1], kvh, vc.shape[2] * vc.shape[3] // (f * kvh))
    if f == 1:
        return kc.reshape(k_shape), vc.reshape(v_shape), step.slots, step.block_tables
    bs, slots = kc.shape[1], step.slots.copy()
    for t in range(slots.shape[0]):
        if slots[t] >= 0:
            slots[t] += (slots[t] // bs) * (f - 1) * bs
    return kc.reshape(k_shape), vc.reshape(v_shape), slots, step.block_tables * f


@njit(cache=True)
def _rotations(step, buf) -> None:
    """Each distinct rotation's cos/sin rows for this step's positions (computed as the op path's
    rope_rows does, so both paths rotate by the same bits; a padded pair past a rotation's own dims
    fills a column nothing reads)."""
    tab = np.empty(step.positions.shape[0], np.int64)
    for r in range(step.rope_dims.shape[0]):
        tab[:] = -1
        layers.rope_rows(step.positions, step.rope_freqs[r], step.rope_mscale[r], tab, buf.cos[r], buf.sin[r])


@njit(cache=True)
def _qkv(il, w, dims, buf, stores, nth):
    """q, k, v of buf.h (q alone where the layer stores no K/V), with biases and q/k norms; returns
    the (q, k) to rotate."""
    if stores:
        _project(w.qkv[il], w.gemm, w.quantize, buf.h, (buf.q, buf.k, buf.v), nth)
    else:
        _project(w.qkv[il, :1], w.gemm, w.quantize, buf.h, (buf.q,), nth)
    return _qkv_finish(il, w, dims, buf, stores)


@njit(cache=True)
def _qkv_finish(il, w, dims, buf, stores):
    """_qkv after its projection (kernels/hybrid_decoder.py projects a gate with q, k, v)."""
    T, hd = buf.h.shape[0], buf.q.shape[2]
    nq, nkv = buf.q.shape[1] * hd, buf.k.shape[1] * hd
    if w.flags[il, F_BIAS]:
        _add_bias(buf.q.reshape(T, -1), w.bq[il, :nq])
        _add_bias(buf.k.reshape(T, -1), w.bk[il, :nkv])
        _add_bias(buf.v.reshape(T, -1), w.bv[il, :nkv])
    if w.flags[il, F_V_NORM] and stores:  # in place: each row is read before it is written
        _heads_norm(buf.v, w.v_norm[il, :hd], dims.eps, buf.v)
    if not w.flags[il, F_QK_NORM]:
        return buf.q, buf.k
    _heads_norm(buf.q, w.q_norm[il, :hd], dims.eps, buf.att)
    if stores:
        _heads_norm(buf.k, w.k_norm[il, :hd], dims.eps, buf.kn)
    return buf.att, buf.kn


@njit(cache=True)
def _temperature(q, positions, scale, length) -> None:
    """q[t] *= 1 + scale * ln(floor(pos_t / length) + 1): the attention temperature (LayerSpec)."""
    for t in range(q.shape[0]):
        f = np.float32(np.log(np.floor(np.float64(positions[t]) / length) + 1.0) * scale + 1.0)
        for h in range(q.shape[1]):
            for j in range(q.shape[2]):
                q[t, h, j] = q[t, h, j] * f


@njit(cache=True)
def _attention_block(il, x, w, dims, step, kv, buf, nth):
    """x += [post-norm] o_proj(attention(rope(q, k), v)) of rms_norm(x), k/v stored in the cache."""
    layers.rms_norm_rows(x, w.attn_norm[il], dims.eps, buf.h)
    stores = w.flags[il, F_KV_LAYER] == il
    q, k = _qkv(il, w, dims, buf, stores, nth)
    _rope_attend(il, w, dims, step, kv, q, k, buf, stores, nth)
    _attention_out(il, x, w, dims, buf, nth)


@njit(cache=True)
def _rope_attend(il, w, dims, step, kv, q, k, buf, stores, nth) -> None:
    """Rotate q and k, store k/v in the cache (where the layer stores any), attend: the attention in
    buf.att."""
    k_cache, v_cache, slots, tables = _layer_cache(il, w, step, kv)
    r = w.flags[il, F_ROPE]
    dim, neox = step.rope_dims[r, 0], step.rope_dims[r, 1] != 0
    if stores:
        layers.rope_store_kv(q, k, buf.v, buf.cos[r], buf.sin[r], dim, neox, k_cache, v_cache, slots,
                             buf.q, buf.k)  # fmt: skip
    else:
        layers.rope_apply(q, buf.cos[r], buf.sin[r], dim, neox, buf.q)
    if w.attn_temp[il, 0] != 0.0:
        _temperature(buf.q, step.positions, w.attn_temp[il, 0], w.attn_temp[il, 1])
    window, cap = w.flags[il, F_WINDOW], w.softcap[il]
    sinks = w.extras.sinks[il] if w.flags[il, F_SINKS] else w.extras.sinks[il, :0]
    _attend(buf.q, k_cache, v_cache, step, tables, dims.attn_scale, window, cap, sinks, buf.att, nth)


@njit(cache=True)
def _attention_out(il, x, w, dims, buf, nth) -> None:
    """x += [post-norm] o_proj(buf.att) [+ its bias]."""
    _project(w.o[il], w.gemm, w.quantize, buf.att.reshape(x.shape[0], -1), (buf.o,), nth)
    if w.flags[il, F_O_BIAS]:
        _add_bias(buf.o, w.extras.bo[il])
    _residual(x, buf.o, w.flags[il, F_POST_ATTN], w.post_attn_norm[il], dims.eps, buf.h)


@njit(cache=True)
def _residual(x, y, post_norm, weight, eps, tmp) -> None:
    """x += y, or x += rms_norm(y) where the spec asks for a post-norm."""
    if post_norm:
        layers.rms_norm_rows(y, weight, eps, tmp)
        _add_rows(x, tmp)
    else:
        _add_rows(x, y)


@njit(cache=True)
def _down(il, w, buf, nth) -> None:
    """buf.down = buf.act @ W_down.T with the layer's activation rounding (see linear_precise)."""
    mode = w.flags[il, F_DOWN]
    if mode == DOWN_INT16:
        t = w.down16[il]
        matmul.launch_linear16(t[0], t[1], t[2], t[3], t[4], buf.act, buf.down, nth)
    elif mode == DOWN_TWO_PASS and w.quantize:  # (the float path has float activations already)
        T = buf.act.shape[0]
        with_residual(buf.act, buf.act2[: 2 * T], matmul.table_rounding(w.down[il], True))  # (exact sums:
        # the plan's two-pass tables say Q8_0 where the weights' own is Q8_1, numba_stack._precise_down)
        _project(w.down[il], w.gemm, w.quantize, buf.act2[: 2 * T], (buf.down2[: 2 * T],), nth)
        for t in range(T):
            for j in range(buf.down.shape[1]):
                buf.down[t, j] = buf.down2[t, j] + buf.down2[T + t, j]
    else:
        _project(w.down[il], w.gemm, w.quantize, buf.act, (buf.down,), nth)


@njit(cache=True)
def _dense_ffn(il, w, buf, nth):
    """buf.down = down(act(gate(h)) * up(h)) of h = buf.h."""
    _project(w.gate_up[il], w.gemm, w.quantize, buf.h, (buf.gate, buf.up), nth)
    if w.flags[il, F_GELU]:
        layers.geglu_rows(buf.gate, buf.up, buf.act)
    elif w.flags[il, F_OAI]:
        layers.swiglu_oai_rows(buf.gate, buf.up, buf.act)
    else:
        layers.swiglu_rows(buf.gate, buf.up, buf.act)
    _down(il, w, buf, nth)


@njit(cache=True)
def _routed(il, w, h, hr, out, nth):
    """out = the routed experts' weighted sum of h, routed on hr (kernels/moe.py)."""
    x, biased = w.extras, w.flags[il, F_EXPERT_BIAS] != 0
    rb = x.router_b[il] if biased else x.router_b[il, :0]
    gb, ub, db = x.gate_exps_b[il], x.up_exps_b[il], x.down_exps_b[il]
    if not biased:
        gb, ub, db = gb[:0], ub[:0], db[:0]
    ds = x.down_exps_s[il] if w.flags[il, F_EXPERT_SCALE] else x.down_exps_s[il, :0]
    renorm = w.flags[il, F_RENORM] != 0
    act = moe.ACT_OAI if w.flags[il, F_OAI] else moe.ACT_GELU if w.flags[il, F_GELU] else moe.ACT_SILU
    moe.moe_ffn_ext(h, hr, w.router[il], w.gate_exps[il], w.up_exps[il], w.down_exps[il], w.gemm, w.quantize,
                    w.flags[il, F_EXPERTS], renorm, act, rb, gb, ub, db, ds, out, w.moe_stats,
                    nth)  # fmt: skip


@njit(cache=True)
def _parallel_experts(il, x, w, dims, buf, nth):
    """buf.down = post_1(dense(norm(x))) + post_2(experts(norm_2(x))), routed on rms_norm(x) * router_norm
    (gemma4); the experts' sum in buf.o."""
    e, eps = w.extras, dims.eps
    layers.rms_norm_rows(x, w.ffn_norm[il], eps, buf.h)
    _dense_ffn(il, w, buf, nth)
    dense, hr = np.empty_like(x), np.empty_like(x)
    layers.rms_norm_rows(buf.down, e.post_ffn_norm_1[il], eps, dense)
    layers.rms_norm_rows(x, e.router_norm[il], eps, hr)
    layers.rms_norm_rows(x, e.ffn_norm_2[il], eps, buf.h)
    _routed(il, w, buf.h, hr, buf.o, nth)
    layers.rms_norm_rows(buf.o, e.post_ffn_norm_2[il], eps, buf.down)
    _add_rows(buf.down, dense)


@njit(cache=True)
def _moe_ffn(il, w, buf, nth):
    """buf.down = the routed experts' weighted sum of h = buf.h (in buf.o, free after attention), plus
    the dense FFN times sigmoid(h . shexp_gate) where the layer has a shared expert."""
    _routed(il, w, buf.h, buf.h, buf.o, nth)
    T = buf.h.shape[0]
    if not w.flags[il, F_SHARED]:
        buf.down[:] = buf.o
        return
    _dense_ffn(il, w, buf, nth)
    g = np.empty(T, np.float32)
    moe.sigmoid_gate(buf.h, w.shexp_gate[il], g)
    for t in range(T):
        for j in range(buf.down.shape[1]):
            buf.down[t, j] = buf.o[t, j] + buf.down[t, j] * g[t]


@njit(cache=True)
def _ffn_block(il, x, w, dims, buf, nth):
    """x += [post-norm] ffn(h), h = rms_norm(x): the dense FFN or the experts (or gemma4's both, each
    from its own norm of x)."""
    if w.flags[il, F_PARALLEL]:
        _parallel_experts(il, x, w, dims, buf, nth)
        _residual(x, buf.down, w.flags[il, F_POST_FFN], w.post_ffn_norm[il], dims.eps, buf.h)
        return
    layers.rms_norm_rows(x, w.ffn_norm[il], dims.eps, buf.h)
    if w.flags[il, F_EXPERTS]:
        _moe_ffn(il, w, buf, nth)
    else:
        _dense_ffn(il, w, buf, nth)
    _residual(x, buf.down, w.flags[il, F_POST_FFN], w.post_ffn_norm[il], dims.eps, buf.h)


@njit(cache=True)
def _per_layer_input(il, x, w, dims, inp, buf, nth) -> None:
    """x += rms_norm(proj(gelu(gate(x)) * inp)): the layer's per-layer input (inp (T, P))."""
    T, P = inp.shape[0], inp.shape[1]
    g, act = np.empty((T, P), np.float32), np.empty((T, P), np.float32)
    _project(w.ple_gate[il], w.gemm, w.quantize, x, (g,), nth)
    layers.geglu_rows(g, inp, act)
    _project(w.ple_proj[il], w.gemm, w.quantize, act, (buf.o,), nth)
    layers.rms_norm_rows(buf.o, w.ple_norm[il], dims.eps, buf.h)
    _add_rows(x, buf.h)


@njit(cache=True, nogil=True)
def decoder_stack(x, w, dims, step, kv, nth):
    """Run every layer on x (T, dim) in place.  kv = (k cache, v cache), each (L, blocks,
    block_size, kv_heads, head_dim)."""
    half = max(1, step.rope_freqs.shape[1])
    buf = _buffers(x.shape[0], x.shape[1], dims, step.rope_dims.shape[0], half)
    _rotations(step, buf)
    for il in range(w.flags.shape[0]):
        lb = _views(buf, il, w, dims)
        _attention_block(il, x, w, dims, step, kv, lb, nth)
        _ffn_block(il, x, w, dims, lb, nth)
        if w.flags[il, F_PER_LAYER]:
            _per_layer_input(il, x, w, dims, step.per_layer[il], lb, nth)
        if w.out_scale[il] != 1.0:
            _scale_rows(x, w.out_scale[il])
    # keep the buffers alive past the kernels that only saw their addresses
    return buf.q.size + buf.k.size + buf.v.size + buf.o.size + buf.gate.size + buf.up.size + buf.down.size \
        + buf.act2.size + buf.down2.size  # fmt: skip
