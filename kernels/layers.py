"""Element-wise and per-row layers: RMSNorm, rotary embedding, SwiGLU / GeGLU, KV-cache writes.

These are small next to the matmuls, so they run on one thread: a parallel launch costs more than
the work.  fastmath is safe here: it only reorders sums (rms_norm's sum of squares is accumulated in
float64 like the reference) and lets LLVM vectorise; exp uses simd.fast_exp (~2 ulp) instead of a
scalar libm call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kv import kv_set_row
from .kv_rotation import key_rotation, value_rotation
from .simd import f32, fast_exp


@njit(cache=True, fastmath=True, error_model="numpy")
def rms_norm_rows(x, weight, eps, out) -> None:
    """out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight, for x (rows, d)."""
    d = x.shape[1]
    for i in range(x.shape[0]):
        ss = 0.0
        for j in range(d):
            v = x[i, j]
            ss += np.float64(v * v)
        inv = f32(1.0) / np.sqrt(f32(ss / d) + f32(eps))
        for j in range(d):
            out[i, j] = x[i, j] * inv * weight[j]


@njit(cache=True, error_model="numpy")  # no fastmath: libm's cos/sin, the same bits in every caller
def rope_rows(positions, freqs, mscale, tab_pos, cos, sin) -> None:
    """Make rows 0..T-1 of the cos/sin tables hold positions[t]; rows already holding that
    position (tab_pos[t] == positions[t]) are kept, so every layer after the first in a step
    computes nothing.  cos/sin of pos * freqs[i] (RopeSpec.frequencies: base, scaling, per-pair
    factors, YaRN) times mscale are computed in float64 like the reference and rounded once."""
    for t in range(positions.shape[0]):
        if tab_pos[t] == positions[t]:
            continue
        for i in range(freqs.shape[0]):
            a = np.float64(positions[t]) * freqs[i]
            cos[t, i] = np.cos(a) * mscale
            sin[t, i] = np.sin(a) * mscale
        tab_pos[t] = positions[t]


@njit(cache=True, error_model="numpy")  # no fastmath: FMA contraction would differ between callers
def rope_apply(x, cos, sin, rope_dim, neox, out) -> None:
    """Rotate x (T, heads, D) into out (may be x itself).  Normal mode rotates pairs (2i, 2i+1),
    NEOX (i, i + half); dimensions from rope_dim on are copied."""
    half = rope_dim // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(half):
                i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[t, h, i0], x[t, h, i1]
                out[t, h, i0] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i1] = a * sin[t, i] + b * cos[t, i]
            for j in range(rope_dim, x.shape[2]):
                out[t, h, j] = x[t, h, j]


@njit(cache=True)
def rope_store_kv(q, k, v, cos, sin, rope_dim, neox, k_cache, v_cache, slots, q_out, k_out) -> None:
    """The attention prologue in one call: rotate q and k by the cos/sin rows (see rope_rows), write
    the rotated k and v into the paged cache.  Same results as reference rope, rope, store_kv."""
    rope_apply(q, cos, sin, rope_dim, neox, q_out)
    rope_apply(k, cos, sin, rope_dim, neox, k_out)
    store_kv_rows(k_cache, v_cache, k_out, v, slots)


@njit(cache=True, fastmath=True, error_model="numpy")
def swiglu_rows(gate, up, out) -> None:
    """silu(gate) * up = gate / (1 + exp(-gate)) * up, for (rows, d) arrays."""
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = gate[i, j]
            out[i, j] = g / (f32(1.0) + fast_exp(-g)) * up[i, j]


_OAI_ALPHA, _OAI_LIMIT = f32(1.702), f32(7.0)  # models/spec.py's OAI_ALPHA, OAI_LIMIT (llama.cpp's)


@njit(cache=True, fastmath=True, error_model="numpy")
def swiglu_oai_rows(gate, up, out) -> None:
    """gpt-oss's clamped SwiGLU: g = min(gate, 7), u = clip(up, -7, 7), g * sigmoid(1.702 g) * (u + 1)."""
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = min(gate[i, j], _OAI_LIMIT)
            u = min(max(up[i, j], -_OAI_LIMIT), _OAI_LIMIT)
            out[i, j] = g / (f32(1.0) + fast_exp(-_OAI_ALPHA * g)) * (u + f32(1.0))


_SQRT_2_OVER_PI = f32(np.sqrt(2.0 / np.pi))


@njit(cache=True, fastmath=True, error_model="numpy")
def geglu_rows(gate, up, out) -> None:
    """gelu_tanh(gate) * up; tanh(z) = 1 - 2 / (exp(2z) + 1), which vectorises."""
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = gate[i, j]
            z = _SQRT_2_OVER_PI * (g + f32(0.044715) * g * g * g)
            th = f32(1.0) - f32(2.0) / (fast_exp(f32(2.0) * z) + f32(1.0))
            out[i, j] = f32(0.5) * g * (f32(1.0) + th) * up[i, j]


@njit(cache=True)
def store_kv_rows(k_cache, v_cache, k, v, slot_mapping) -> None:
    """k, v (T, KVH, D) into the paged caches (num_blocks, block_size, KVH, D) at slot_mapping (T,).
    Negative slots (padding) are skipped. A q8_0 cache's rows are rotated first, as llama.cpp's
    (kv_rotation.py)."""
    bs = k_cache.shape[1]
    rk, rv = key_rotation(k.shape[2]), value_rotation(v.shape[2])
    for t in range(k.shape[0]):
        s = slot_mapping[t]
        if s < 0:
            continue
        blk, off = s // bs, s % bs
        kv_set_row(k_cache, blk, off, k[t], rk)
        kv_set_row(v_cache, blk, off, v[t], rv)
