"""Gated DeltaNet (Qwen3.5, Qwen3-Next linear attention): the short causal convolution with its rolling
window, and the gated delta rule over a per-sequence state, for a batch of sequences at any positions.

A batch holds S sequences' tokens contiguously (qsl, as the paged attention's query_start_loc); each
sequence owns slot `slots[s]` of the state pool. A sequence whose first token in the step is at
position 0 starts from a zero state (so a slot never needs clearing); any other continues from the
slot's state (a decode step, or the next chunk of a chunked prefill).

Per value head h of a token (k, q L2-normalised; key head h // (Hv / Hk) where `interleaved`, else
h % Hk, as llama.cpp repeats them per architecture):
    S = S * exp(g);  d = (v - S k) * beta;  S = S + d k^T;  o = (S q) / sqrt(Dk)
S is (Dv, Dk), row j holding what value dim j reads from the keys: every step of the rule is local to
a row, so one pass over the state per token does all of it. Prefill runs the same recurrence token by
token (per head the state stays in cache, and the recurrence is a few percent of the layer's
matmuls on a CPU); kernels/gated_delta_reference.py has the NumPy twins, the chunkwise form included.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import f32, fast_exp

# A step's conv splits its channels over the threads from this many (tokens x channels) values: one
# decode token's few thousand are done before a launch would have woken the other thread.
CONV_PARALLEL_MIN = 1 << 16


@njit(cache=True, nogil=True)
def conv_silu(x, wt, qsl, positions, slots, conv_state, out) -> None:
    """out = silu(causal depthwise conv of x) per sequence. x, out (T, C); wt (K, C), tap K-1 on the
    current token; conv_state (slots, K-1, C): the K-1 inputs before the step, updated in place."""
    _conv_part(x, wt, qsl, positions, slots, conv_state, out, 0, 1)


@njit(cache=True, parallel=True, nogil=True)
def conv_silu_par(x, wt, qsl, positions, slots, conv_state, out, nth) -> None:
    """conv_silu with the channels split over nth threads (each channel is its own convolution), at
    multiples of 64: a channel then falls in the same place of the vector loops as in one pass, so its
    bits are conv_silu's."""
    for c in prange(nth):
        _conv_part(x, wt, qsl, positions, slots, conv_state, out, c, nth)


@njit(cache=True, nogil=True)
def _conv_part(x, wt, qsl, positions, slots, conv_state, out, c, nth) -> None:
    """Part c of nth of the channels (both conv_silu forms call the kernel through here, so it is
    compiled once, for run-time bounds)."""
    C = wt.shape[1]
    c0, c1 = (c * C // nth) // 64 * 64, ((c + 1) * C // nth) // 64 * 64 if c < nth - 1 else C
    _conv_channels(x, wt, qsl, positions, slots, conv_state, out, c0, c1)


@njit(cache=True, fastmath=True, error_model="numpy", boundscheck=False)
def _conv_channels(x, wt, qsl, positions, slots, conv_state, out, c0, c1) -> None:
    """conv_silu's channels c0..c1-1. Each tap adds a whole row (from x, or from the window before the
    step's first tokens), so the channel loops vectorise (over unsigned indices: a signed one of unknown
    sign is checked for wrapping around at every access)."""
    K, c0, c1 = wt.shape[0], np.uint64(c0), np.uint64(c1)
    for s in range(qsl.shape[0] - 1):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        st = conv_state[slots[s]]
        if positions[a] == 0:
            st[:, c0:c1] = 0.0
        for t in range(a, b):
            row = out[t]
            for i in range(K):
                j = t - (K - 1) + i  # the input row tap i reads
                src = x[j] if j >= a else st[K - 1 + j - a]
                w = wt[i]
                if i == 0:
                    for c in range(c0, c1):
                        row[c] = src[c] * w[c]
                else:
                    for c in range(c0, c1):
                        row[c] += src[c] * w[c]
            for c in range(c0, c1):
                row[c] = row[c] / (f32(1.0) + fast_exp(-row[c]))
        for r in range(st.shape[0]):  # ascending: row r + (b - a) is read before it is overwritten
            src = st[r + b - a] if r + b - a < st.shape[0] else x[b - st.shape[0] + r]
            for c in range(c0, c1):
                st[r, c] = src[c]


@njit(cache=True, fastmath=True, error_model="numpy")
def l2_norm_heads(x, n_heads, head_dim, eps) -> None:
    """x[t, h*D:(h+1)*D] /= sqrt(sum of squares + eps) for the first n_heads heads of each row."""
    for t in range(x.shape[0]):
        for h in range(n_heads):
            o = h * head_dim
            ss = 0.0
            for i in range(head_dim):
                ss += np.float64(x[t, o + i] * x[t, o + i])
            inv = f32(1.0 / np.sqrt(ss + eps))
            for i in range(head_dim):
                x[t, o + i] *= inv


@njit(cache=True, fastmath=True, error_model="numpy")
def gates(beta_raw, alpha_raw, dt_bias, a, beta, g) -> None:
    """beta = sigmoid(beta_raw); g = softplus(alpha_raw + dt_bias) * a (a = -exp(A_log) < 0)."""
    for t in range(beta_raw.shape[0]):
        for h in range(beta_raw.shape[1]):
            beta[t, h] = f32(1.0) / (f32(1.0) + np.exp(-beta_raw[t, h]))
            z = alpha_raw[t, h] + dt_bias[h]
            sp = z if z > 20.0 else np.log1p(np.exp(z))
            g[t, h] = sp * a[h]


@njit(cache=True, fastmath=True, error_model="numpy", boundscheck=False)
def _head(mixed, g, beta, a, b, slot_state, fresh, kh, h, n_k, dk, dv, scale, out) -> None:
    """One (sequence, value head): tokens a..b-1 through the rule, state (Dv, Dk) updated in place.
    Per row j of S, one pass reads S k and S q (the decay factored out of both: (e^g S) k = e^g (S k))
    and one writes e^g S + d k^T; the rule's o = (S' q) is then e^g (S q) + d (k . q). k and q are
    copied out of `mixed` first: LLVM cannot tell they do not alias the state, and reloading them
    for every row stopped it vectorising the rows (16x slower)."""
    if fresh:
        slot_state[:] = 0.0
    q0, k0, v0 = kh * dk, n_k * dk + kh * dk, 2 * n_k * dk + h * dv
    kv, qv = np.empty(dk, np.float32), np.empty(dk, np.float32)
    for t in range(a, b):
        eg, bt = np.float32(np.exp(g[t, h])), beta[t, h]
        kq = f32(0.0)
        for i in range(dk):
            kv[i], qv[i] = mixed[t, k0 + i], mixed[t, q0 + i]
            kq += kv[i] * qv[i]
        for j in range(dv):
            row = slot_state[j]
            sk, sq = f32(0.0), f32(0.0)
            for i in range(dk):
                sk += row[i] * kv[i]
                sq += row[i] * qv[i]
            d = (mixed[t, v0 + j] - eg * sk) * bt
            for i in range(dk):
                row[i] = row[i] * eg + d * kv[i]
            out[t, h * dv + j] = (eg * sq + d * kq) * scale


@njit(cache=True, nogil=True)
def _items(mixed, g, beta, qsl, positions, slots, state, n_k, dk, interleaved, out, c, nth) -> None:
    n_v, dv = g.shape[1], state.shape[2]
    scale = f32(1.0 / np.sqrt(dk))
    for item in range(c, (qsl.shape[0] - 1) * n_v, nth):
        s, h = item // n_v, item % n_v
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        kh = h // (n_v // n_k) if interleaved else h % n_k
        _head(mixed, g, beta, a, b, state[slots[s], h], positions[a] == 0, kh, h, n_k, dk, dv, scale, out)


@njit(cache=True, parallel=True, nogil=True)
def delta_rule_par(mixed, g, beta, qsl, positions, slots, state, n_k, dk, interleaved, out, nth) -> None:
    """delta_rule_serial with the (sequence, head) items spread over nth threads."""
    for c in prange(nth):
        _items(mixed, g, beta, qsl, positions, slots, state, n_k, dk, interleaved, out, c, nth)


@njit(cache=True, nogil=True)
def delta_rule_serial(mixed, g, beta, qsl, positions, slots, state, n_k, dk, interleaved, out) -> None:
    """The gated delta rule. mixed (T, 2*Hk*Dk + Hv*Dv): q | k (L2-normalised) | v per token; g, beta
    (T, Hv); state (slots, Hv, Dv, Dk); out (T, Hv*Dv)."""
    _items(mixed, g, beta, qsl, positions, slots, state, n_k, dk, interleaved, out, 0, 1)


@njit(cache=True, fastmath=True, error_model="numpy")
def gated_rms_norm(o, z, weight, eps) -> None:
    """o (T, H*D) <- rms_norm(o per head of D = len(weight)) * weight * silu(z), in place."""
    d = weight.shape[0]
    for t in range(o.shape[0]):
        for h in range(o.shape[1] // d):
            base = h * d
            ss = 0.0
            for i in range(d):
                ss += np.float64(o[t, base + i] * o[t, base + i])
            inv = f32(1.0) / np.sqrt(f32(ss / d) + f32(eps))
            for i in range(d):
                zi = z[t, base + i]
                o[t, base + i] = o[t, base + i] * inv * weight[i] * (zi / (f32(1.0) + fast_exp(-zi)))


@njit(cache=True, nogil=True)
def mixer_core(qkv, z, beta_raw, alpha_raw, conv_wt, dt_bias, a, norm_w, qsl, positions, slots, conv_state,
               ssm_state, n_k, dk, interleaved, eps, mixed, out, nth) -> None:  # fmt: skip
    """A Gated DeltaNet layer between its input projections (qkv, z, beta_raw, alpha_raw) and its
    output projection: conv + silu into `mixed`, L2 norms, gates, the rule, the gated norm into out.
    The conv splits its channels over the threads, the rule its (sequence, head) items."""
    if nth > 1 and qkv.shape[0] * qkv.shape[1] >= CONV_PARALLEL_MIN:
        conv_silu_par(qkv, conv_wt, qsl, positions, slots, conv_state, mixed, nth)
    else:
        conv_silu(qkv, conv_wt, qsl, positions, slots, conv_state, mixed)
    l2_norm_heads(mixed, 2 * n_k, dk, eps)
    beta = np.empty_like(beta_raw)
    g = np.empty_like(beta_raw)
    gates(beta_raw, alpha_raw, dt_bias, a, beta, g)
    work = qkv.shape[0] * ssm_state.shape[1] * ssm_state.shape[2] * dk
    if nth > 1 and work >= 1 << 15:
        delta_rule_par(mixed, g, beta, qsl, positions, slots, ssm_state, n_k, dk, interleaved, out, nth)
    else:
        delta_rule_serial(mixed, g, beta, qsl, positions, slots, ssm_state, n_k, dk, interleaved, out)
    gated_rms_norm(out, z, norm_w, eps)
