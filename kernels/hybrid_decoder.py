"""The fused layer stack of hybrid models (Qwen3.5, Qwen3-Next): kernels/decoder.py's stack with two
more layer kinds, in one compiled call.

Per layer, as `RecWeights.kind` says: KIND_ATTENTION runs decoder.py's attention block as it is;
KIND_GATED_ATTENTION projects q, k, v and a per-head gate in one launch, then the same q/k norms, RoPE,
KV store and paged attention, and multiplies the attention by sigmoid(gate) before the output
projection; KIND_GATED_DELTA projects q|k|v, z, beta and alpha in one launch, runs
gated_delta.mixer_core over the sequences' state slots, and projects out. The FFN (dense, or experts
with a shared expert) is decoder.py's. The state pool is (conv, ssm) arrays of (recurrent layers,
slots, ...) and `RecStep.slots` each sequence's slot.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from . import decoder as dk
from . import gated_delta, layers
from .simd import f32, fast_exp

KIND_ATTENTION, KIND_GATED_ATTENTION, KIND_GATED_DELTA = 0, 1, 2


class RecWeights(NamedTuple):
    kind: np.ndarray  # (L,) int64 KIND_*
    state_index: np.ndarray  # (L,) int64: a recurrent layer's index in the state pool (-1: none)
    gated_qkv: np.ndarray  # (L, 4, 6) launch tables q, k, v, gate (zeros: not a gated attention layer)
    gdn_in: np.ndarray  # (L, 4, 6) launch tables q|k|v, z, beta, alpha (zeros: not a delta-net layer)
    gdn_out: np.ndarray  # (L, 1, 6)
    conv_wt: np.ndarray  # (L, taps, channels) float32
    dt_bias: np.ndarray  # (L, Hv)
    a: np.ndarray  # (L, Hv)
    norm: np.ndarray  # (L, D)


class RecDims(NamedTuple):
    n_k: int
    n_v: int
    head_dim: int
    channels: int
    interleaved: bool


class RecStep(NamedTuple):
    conv: np.ndarray  # (recurrent layers, slots, taps-1, channels)
    ssm: np.ndarray  # (recurrent layers, slots, Hv, D, D)
    slots: np.ndarray  # (S,) int64


class RecBuffers(NamedTuple):
    gate: np.ndarray  # (T, n_heads, head_dim)
    qkv: np.ndarray  # (T, channels)
    z: np.ndarray  # (T, Hv*D)
    beta: np.ndarray  # (T, Hv)
    alpha: np.ndarray
    mixed: np.ndarray  # (T, channels)
    o: np.ndarray  # (T, Hv*D)


@njit(cache=True)
def _rec_sizes(T, dims, rd):
    """Floats of RecBuffers' fields but the gate, in their order, and the gate's offset in the arena."""
    vd = rd.n_v * rd.head_dim
    sizes = np.array((rd.channels, vd, rd.n_v, rd.n_v, rd.channels, vd), np.int64) * T
    gate_at = dk._arena_sizes(T, 0, dims)[:5].sum()  # after q, k, v, kn and att
    return sizes, gate_at


@njit(cache=True)
def _arena(T, d, dims, rd):
    """decoder._buffers_in's arena, grown to what RecBuffers need (see _rec_buffers)."""
    sizes, gate_at = _rec_sizes(T, dims, rd)
    rec = max(sizes.sum(), gate_at + T * dims.n_heads * dims.head_dim)
    return np.empty(max(dk._arena_sizes(T, d, dims).sum(), rec), np.float32)


@njit(cache=True)
def _rec_buffers(arena, T, dims, rd):
    """RecBuffers inside the decoder's arena (_arena): a Gated DeltaNet layer's scratch over q .. down,
    which it does not use; the gated attention's gate over the FFN's part, which attention does not
    use."""
    sizes, gate_at = _rec_sizes(T, dims, rd)
    ends = np.cumsum(sizes)

    def part(i, cols):
        return arena[ends[i] - sizes[i] : ends[i]].reshape((T, cols))

    gate = arena[gate_at : gate_at + T * dims.n_heads * dims.head_dim]
    vd = rd.n_v * rd.head_dim
    return RecBuffers(
        gate.reshape((T, dims.n_heads, dims.head_dim)), part(0, rd.channels), part(1, vd), part(2, rd.n_v),
        part(3, rd.n_v), part(4, rd.channels), part(5, vd),
    )  # fmt: skip


@njit(cache=True, fastmath=True, error_model="numpy")
def _sigmoid_mul(x, gate) -> None:
    """x *= sigmoid(gate), for (T, heads, head_dim) arrays."""
    x2, g2 = x.reshape(x.shape[0], -1), gate.reshape(gate.shape[0], -1)
    for t in range(x2.shape[0]):
        for j in range(x2.shape[1]):
            x2[t, j] = x2[t, j] / (f32(1.0) + fast_exp(-g2[t, j]))


@njit(cache=True)
def _gated_attention_block(il, x, w, dims, step, kv, rec, rb, buf, nth):
    """decoder._attention_block with q's gate projected beside q, k, v and applied to the attention."""
    layers.rms_norm_rows(x, w.attn_norm[il], dims.eps, buf.h)
    dk._project(rec.gated_qkv[il], w.gemm, w.quantize, buf.h, (buf.q, buf.k, buf.v, rb.gate), nth)
    q, k = dk._qkv_finish(il, w, dims, buf, True)
    dk._rope_attend(il, w, dims, step, kv, q, k, buf, True, nth)
    _sigmoid_mul(buf.att, rb.gate)
    dk._attention_out(il, x, w, dims, buf, nth)


@njit(cache=True)
def _delta_net_block(il, x, w, dims, step, rec, rd, rs, rb, buf, nth):
    """x += [post-norm] out_proj(gated delta rule of rms_norm(x)), the sequences' states advanced."""
    layers.rms_norm_rows(x, w.attn_norm[il], dims.eps, buf.h)
    dk._project(rec.gdn_in[il], w.gemm, w.quantize, buf.h, (rb.qkv, rb.z, rb.beta, rb.alpha), nth)
    j = rec.state_index[il]
    gated_delta.mixer_core(rb.qkv, rb.z, rb.beta, rb.alpha, rec.conv_wt[il], rec.dt_bias[il], rec.a[il],
                           rec.norm[il], step.qsl, step.positions, rs.slots, rs.conv[j], rs.ssm[j], rd.n_k,
                           rd.head_dim, rd.interleaved, dims.eps, rb.mixed, rb.o, nth)  # fmt: skip
    dk._project(rec.gdn_out[il], w.gemm, w.quantize, rb.o, (buf.o,), nth)
    dk._residual(x, buf.o, w.flags[il, dk.F_POST_ATTN], w.post_attn_norm[il], dims.eps, buf.h)


@njit(cache=True, nogil=True)
def hybrid_stack(x, w, dims, step, kv, rec, rd, rs, nth):
    """Run every layer on x (T, dim) in place (see the module docstring)."""
    half = max(1, step.rope_freqs.shape[1])
    T = x.shape[0]
    arena = _arena(T, x.shape[1], dims, rd)
    buf = dk._buffers_in(arena, T, x.shape[1], dims, step.rope_dims.shape[0], half)
    rb = _rec_buffers(arena, T, dims, rd)
    dk._rotations(step, buf)
    for il in range(w.flags.shape[0]):
        kind = rec.kind[il]
        lb = dk._views(buf, il, w, dims)  # the layer's sizes (decoder.py's per-layer columns)
        if kind == KIND_GATED_DELTA:
            _delta_net_block(il, x, w, dims, step, rec, rd, rs, rb, lb, nth)
        elif kind == KIND_GATED_ATTENTION:
            _gated_attention_block(il, x, w, dims, step, kv, rec, rb, lb, nth)
        else:
            dk._attention_block(il, x, w, dims, step, kv, lb, nth)
        dk._ffn_block(il, x, w, dims, lb, nth)
        if w.out_scale[il] != 1.0:
            dk._scale_rows(x, w.out_scale[il])
    # keep the buffers alive past the kernels that only saw their addresses
    return buf.q.size + buf.k.size + buf.v.size + buf.o.size + buf.gate.size + buf.up.size + buf.down.size \
        + buf.act2.size + buf.down2.size + rb.gate.size + rb.qkv.size + rb.z.size + rb.beta.size \
        + rb.alpha.size + rb.o.size  # fmt: skip
