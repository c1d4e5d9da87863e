"""NumPy twins of kernels/gated_delta.py: the Gated DeltaNet mixer in plain float32, with the delta rule
in its recurrent form (one token at a time) and its chunkwise form (a chunk of C tokens at once, as
prefill runs on parallel hardware: the WY representation solves the chunk's triangular system, then
one matmul per chunk carries the state). Both give the same outputs and final state.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def silu(x: np.ndarray) -> np.ndarray:
    return x / (f32(1.0) + np.exp(-x))


def conv_silu(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's (T, C) inputs through the causal depthwise conv (weight (C, K)) and silu; state
    (K-1, C) the inputs before them (None: zeros). Returns (out, new state)."""
    K = weight.shape[1]
    prev = np.zeros((K - 1, x.shape[1]), f32) if state is None else state
    ext = np.concatenate([prev, x.astype(f32)])
    out = sum(ext[i : i + x.shape[0]] * weight[:, i] for i in range(K))
    return silu(out.astype(f32)), ext[x.shape[0] :].copy()


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x over its last axis / sqrt(sum of squares + eps)."""
    ss = np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ss + eps)).astype(f32)


def gates(beta_raw: np.ndarray, alpha_raw: np.ndarray, dt_bias: np.ndarray, a: np.ndarray):
    """(beta, g): sigmoid(beta_raw), softplus(alpha_raw + dt_bias) * a."""
    z = alpha_raw + dt_bias
    softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    return (f32(1.0) / (f32(1.0) + np.exp(-beta_raw))).astype(f32), (softplus * a).astype(f32)


def delta_rule(q, k, v, g, beta, state):
    """Recurrent form for one sequence: q, k (T, H, Dk) per value head (keys already repeated), v (T, H,
    Dv), g, beta (T, H), state (H, Dv, Dk) or None. Returns (out (T, H, Dv), final state)."""
    T, H, dk = q.shape
    S = np.zeros((H, v.shape[2], dk), f32) if state is None else state.astype(f32).copy()
    scale = f32(1.0 / np.sqrt(dk))
    out = np.empty(v.shape, f32)
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        sk = np.einsum("hjk,hk->hj", S, k[t])
        d = (v[t] - sk) * beta[t][:, None]
        S += d[:, :, None] * k[t][:, None, :]
        out[t] = np.einsum("hjk,hk->hj", S, q[t]) * scale
    return out, S


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The chunkwise form of delta_rule (same arguments and results), in float64 inside a chunk."""
    T, H, dk = q.shape
    S = np.zeros((H, v.shape[2], dk)) if state is None else state.astype(np.float64).copy()
    out = np.empty(v.shape, f32)
    scale = 1.0 / np.sqrt(dk)
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        for h in range(H):
            o, S[h] = _chunk(q[sl, h] * scale, k[sl, h], v[sl, h], g[sl, h], beta[sl, h], S[h])
            out[sl, h] = o
    return out, S.astype(f32)


def _chunk(q, k, v, g, beta, S):
    """One chunk of one head. With G the cumulative log decay and D[i, j] = exp(G_i - G_j) (j <= i),
    the state before token i is exp(G_i) S0 + sum_{j<i} D[i, j] u_j k_j^T, where u_j = beta_j (v_j -
    (state before j) k_j): a unit lower-triangular system for u, solved at once."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    G = np.cumsum(g.astype(np.float64))
    D = np.tril(np.exp(G[:, None] - G[None, :]))
    b = beta.astype(np.float64)[:, None]
    A = np.tril(D * (k @ k.T), -1) * b  # u_i = b_i (v_i - e^{G_i} S0 k_i) - sum_{j<i} A[i, j] u_j
    rhs = b * (v - np.exp(G)[:, None] * (k @ S.T))
    u = np.linalg.solve(np.eye(len(G)) + A, rhs)
    out = np.exp(G)[:, None] * (q @ S.T) + (D * (q @ k.T)) @ u
    S = np.exp(G[-1]) * S + (np.exp(G[-1] - G)[:, None] * u).T @ k
    return out, S


def repeat_keys(x: np.ndarray, n_v: int, interleaved: bool) -> np.ndarray:
    """(T, Hk, D) key heads -> (T, Hv, D): value head h reads key head h // (Hv/Hk) or h % Hk."""
    n_k = x.shape[1]
    return np.repeat(x, n_v // n_k, axis=1) if interleaved else np.tile(x, (1, n_v // n_k, 1))


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm(o over its last axis) * weight * silu(z)."""
    ms = np.mean(o.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (o / np.sqrt(ms + eps) * weight * silu(z)).astype(f32)


def mixer(qkv, z, beta_raw, alpha_raw, conv_w, dt_bias, a, norm_w, qsl, positions, slots, conv_state,
          ssm_state, n_k: int, interleaved: bool, eps: float, chunked: bool = True):  # fmt: skip
    """kernels/gated_delta.mixer_core's twin: a batch of sequences (qsl), each through conv, the rule
    (chunkwise for a prefill chunk of more than one token where `chunked`) and the gated norm, its
    slot of conv_state (slots, K-1, C) and ssm_state (slots, Hv, Dv, Dk) updated. (T, Hv*Dv)."""
    n_v, dv, dk = ssm_state.shape[1:]
    beta, g = gates(beta_raw, alpha_raw, dt_bias, a)
    out = np.empty((qkv.shape[0], n_v * dv), f32)
    for s in range(len(qsl) - 1):
        lo, hi = int(qsl[s]), int(qsl[s + 1])
        if lo == hi:
            continue
        fresh, slot = positions[lo] == 0, int(slots[s])
        mixed, conv_state[slot] = conv_silu(qkv[lo:hi], conv_w, None if fresh else conv_state[slot])
        n = hi - lo
        q = repeat_keys(l2_norm(mixed[:, : n_k * dk].reshape(n, n_k, dk), eps), n_v, interleaved)
        k = repeat_keys(l2_norm(mixed[:, n_k * dk : 2 * n_k * dk].reshape(n, n_k, dk), eps), n_v, interleaved)
        v = mixed[:, 2 * n_k * dk :].reshape(n, n_v, dv)
        rule = delta_rule_chunked if chunked and n > 1 else delta_rule
        o, ssm_state[slot] = rule(q, k, v, g[lo:hi], beta[lo:hi], None if fresh else ssm_state[slot])
        out[lo:hi] = gated_rms_norm(o, z[lo:hi].reshape(n, n_v, dv), norm_w, eps).reshape(n, -1)
    return out
