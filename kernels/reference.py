"""Plain NumPy versions of every kernel: the correctness oracle the Numba kernels are tested against.

Shapes: T tokens in a step, S sequences, H query heads, KVH key/value heads, D head dim.
KV cache per layer: (num_blocks, block_size, KVH, D); slot = block * block_size + offset.
"""

from __future__ import annotations

import numpy as np

from ..quant import dequantize
from ..quant.ggml import BLOCK_Q8_0, dequant_q8_0
from ..quant.quantize_legacy import quantize_q8_0
from .act_rounding import BY_GGML_TYPE, ROUND_NONE, ROUND_Q8_0, ROUND_Q8_1, ROUND_Q8_K
from .kv_rotation import key_rotation, value_rotation


def linear(x: np.ndarray, w_raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """x (T, K) @ W.T where W (N, K) is stored quantized -> (T, N), all in float32."""
    w = dequantize(w_raw, ggml_type)
    return x.astype(np.float32) @ w.T


def quantize_activations(x: np.ndarray, rounding: int = ROUND_Q8_0) -> tuple[np.ndarray, ...]:
    """NumPy twin of quantize_act.quantize_rows' x8 (T, K) int8, dx and sx (T, K / 32) float32, rounded as
    act_rounding.ROUND_* says: ggml's Q8_0 (per 32: rint(x * (127 / max|x|)), scale max|x| / 127 rounded
    to float16, sx the scale times sum(x8)), its Q8_1 (the same, sx = float16(max|x| / 127 * sum(x8))) or,
    where K allows, its Q8_K (per 256: s = 127 / max|x|, rint(x * s), scale 1 / s in float32, repeated
    for each 32-block). Zero where 127 / max|x| is 0 or overflows; a float16 value that would be inf stays
    float32."""
    x = np.asarray(x, np.float32)
    g = 256 if rounding == ROUND_Q8_K and x.shape[1] % 256 == 0 else 32
    blocks = x.reshape(x.shape[0], -1, g)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
        inv[~np.isfinite(inv)] = 0
        if g == 256:
            d = np.divide(np.float32(1.0), inv, out=np.zeros_like(inv), where=inv > 0)
        else:
            d = np.where(inv > 0, _f16_or_f32(amax / np.float32(127.0)), np.float32(0.0)).astype(np.float32)
        x8 = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(x.shape)
        dx = np.repeat(d, g // 32, axis=-1)
        sums = x8.reshape(x.shape[0], -1, 32).astype(np.int32).sum(axis=-1).astype(np.float32)
        sx = (dx * sums).astype(np.float32)
        if rounding == ROUND_Q8_1:
            q81 = _f16_or_f32((amax / np.float32(127.0)) * sums)
            sx = np.where(inv > 0, q81, sx).astype(np.float32)
    return x8, dx, sx


def _f16_or_f32(v: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (as float32), those past float16's range left as they are."""
    with np.errstate(over="ignore"):
        v16 = v.astype(np.float16).astype(np.float32)
    return np.where(np.isinf(v16), v, v16).astype(np.float32)


def rounded_activations(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x (T, K) as the integer path multiplies it with a weight of ggml_type: rounded to 8 bits
    (quantize_activations) and back to float32; unchanged for the types that take the float path."""
    x = np.ascontiguousarray(x, np.float32)
    rounding = BY_GGML_TYPE.get(ggml_type, ROUND_NONE)
    if rounding == ROUND_NONE or x.shape[-1] % 32:
        return x
    rows = x.reshape(-1, x.shape[-1])
    x8, dx, _ = quantize_activations(rows, rounding)
    return (x8.reshape(rows.shape[0], -1, 32) * dx[..., None]).reshape(x.shape).astype(np.float32)


def embedding(w_raw: np.ndarray, ggml_type: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of the (vocab, dim) embedding table, dequantized -> (T, dim)."""
    return dequantize(w_raw[ids], ggml_type)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., d) normalised over the last axis, times weight (d,)."""
    x = x.astype(np.float32)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    return x / np.sqrt(mean_sq + np.float32(eps)) * weight


def rope_frequencies(rope_dim: int, base: float, freq_scale: float = 1.0) -> np.ndarray:
    """Plain RoPE's per-pair speeds freq_scale * base^(-2i / rope_dim) (RopeSpec.frequencies adds the
    per-pair factors and YaRN)."""
    return freq_scale * base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


def rope_cos_sin(
    positions: np.ndarray, freqs: np.ndarray, mscale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (T, len(freqs)) of pos * freqs[i], times mscale, rounded once to float32."""
    angles = positions.astype(np.float64)[:, None] * freqs[None, :]
    return (np.cos(angles) * mscale).astype(np.float32), (np.sin(angles) * mscale).astype(np.float32)


def rope(
    x: np.ndarray, positions: np.ndarray, rope_dim: int, base: float, neox: bool, freq_scale: float = 1.0,
    freqs: np.ndarray | None = None, mscale: float = 1.0,
) -> np.ndarray:  # fmt: skip
    """Rotary embedding on x (T, heads, D). llama 'normal' mode rotates adjacent pairs (2i, 2i+1);
    NEOX mode rotates (i, i + rope_dim/2). Dimensions past rope_dim pass through. `freqs` (a
    RopeSpec's frequencies()) replaces the plain speeds from base and freq_scale."""
    if freqs is None:
        freqs = rope_frequencies(rope_dim, base, freq_scale)
    cos, sin = rope_cos_sin(positions, freqs, mscale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.astype(np.float32).copy()
    half = rope_dim // 2
    if neox:
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dim] = a * sin + b * cos
    else:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * cos - b * sin
        out[..., 1:rope_dim:2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu(gate) * up


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clip(up, -limit, limit),
    g * sigmoid(alpha * g) * (u + 1)."""
    g = np.minimum(gate, np.float32(limit))
    u = np.clip(up, np.float32(-limit), np.float32(limit))
    return g / (np.float32(1.0) + np.exp(np.float32(-alpha) * g)) * (u + np.float32(1.0))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x**3)))


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gelu_tanh(gate) * up


def store_kv(
    k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray
) -> None:
    """Write k, v (T, KVH, D) into the paged cache at `slot_mapping` (T,), in the cache's type."""
    nb, bs = k_cache.shape[:2]
    if k_cache.dtype == np.int8:  # llama.cpp's rotation of a quantized cache (kv_rotation.py)
        k = hadamard(k, key_rotation(k.shape[-1]))
    if v_cache.dtype == np.int8:
        v = hadamard(v, value_rotation(v.shape[-1]))
    k_cache.reshape(nb * bs, *k_cache.shape[2:])[slot_mapping] = to_storage(k, k_cache.dtype)
    v_cache.reshape(nb * bs, *v_cache.shape[2:])[slot_mapping] = to_storage(v, v_cache.dtype)


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """x (..., D) with each n-chunk of the last axis times H_n as kv_rotation.fwht computes it (the
    same float32 operations in the same order); x itself when n is 0."""
    if not n:
        return x
    lead = (*x.shape[:-1], x.shape[-1] // n)
    y = np.asarray(x, np.float32).reshape(*lead, n) * (np.float32(1.0) / np.sqrt(np.float32(n)))
    span = 1
    while span < n:
        y = y.reshape(*lead, n // (2 * span), 2, span)
        y = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2)
        span *= 2
    return y.reshape(x.shape)


def to_storage(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x (..., D) float32 in a cache's storage type: int8 holds q8_0 as ggml's block bytes (kernels/kv.py)."""
    if dtype != np.int8:
        return x.astype(dtype)
    blocks = quantize_q8_0(np.ascontiguousarray(x, np.float32).reshape(-1, 32))
    return blocks.view(np.int8).reshape(*x.shape[:-1], -1)


def from_storage(raw: np.ndarray, head_dim: int) -> np.ndarray:
    """q8_0 cache rows (..., width) as float32 (..., head_dim); other types' rows as they are."""
    if raw.dtype != np.int8:
        return raw
    blocks = np.ascontiguousarray(raw).reshape(-1).view(BLOCK_Q8_0)
    return dequant_q8_0(blocks).reshape(*raw.shape[:-1], head_dim)


def quantize_query_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (n, D) float32 as ggml's AVX2 quantize_row_q8_0 (llama.cpp's Q before a q8_0 K cache):
    quants (n, D / 32, 32) int8 = rint(x * 127 / max|x|), scales (n, D / 32) f16-rounded max|x| / 127."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax != 0)
    quants = np.rint(blocks * inv[..., None]).astype(np.int8)
    return quants, (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)


def q8_key_scores(x: np.ndarray, raw: np.ndarray, scale: float) -> np.ndarray:
    """(n, L) scores of queries x (n, D) against q8_0 key rows raw (L, width): per 32-block, the int32
    dot of the int8 quants times (key scale * query scale), summed over blocks, then times scale."""
    quants, dq = quantize_query_q8(x)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(BLOCK_Q8_0).reshape(raw.shape[0], -1)
    dk = blocks["d"].astype(np.float32)
    dots = np.einsum("nbe,lbe->nlb", quants.astype(np.int32), blocks["qs"].astype(np.int32))
    return ((dk[None] * dq[:, None]) * dots.astype(np.float32)).sum(axis=-1) * np.float32(scale)


def gather_kv(cache: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    """The first `length` positions of one sequence, read through its block table -> (length, KVH, D)."""
    bs = cache.shape[1]
    n_blocks = (length + bs - 1) // bs
    return cache[block_table[:n_blocks]].reshape(n_blocks * bs, *cache.shape[2:])[:length]


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal grouped-query attention for a mixed batch of prefill chunks and decodes.

    Sequence s owns queries q[query_start_loc[s]:query_start_loc[s+1]], which are the last tokens of
    its context_lens[s] cached positions. A query at position p sees positions <= p, and with a sliding
    window only those > p - sliding_window. softcap > 0 maps scores to softcap * tanh(score / softcap).
    sinks (n_heads,): a logit per head that joins each softmax's denominator (gpt-oss), no value.
    """
    out = np.zeros_like(q, dtype=np.float32)
    n_heads, kv_heads = q.shape[1], k_cache.shape[2]
    group = n_heads // kv_heads
    for s in range(len(context_lens)):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        length = int(context_lens[s])
        raw_keys = gather_kv(k_cache, block_tables[s], length)
        keys = from_storage(raw_keys, q.shape[2])  # (L, KVH, D)
        values = from_storage(gather_kv(v_cache, block_tables[s], length), q.shape[2])
        q_pos = np.arange(length - (q1 - q0), length)
        k_pos = np.arange(length)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window > 0:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        for h in range(n_heads):
            kh = h // group
            if k_cache.dtype == np.int8:  # llama.cpp's integer dots with a (rotated) quantized query
                rotated = hadamard(q[q0:q1, h, :], key_rotation(q.shape[2]))
                scores = q8_key_scores(rotated, raw_keys[:, kh], scale)
            else:
                scores = (q[q0:q1, h, :] @ keys[:, kh, :].T) * np.float32(scale)
            if softcap > 0:
                scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
            scores = np.where(mask, scores, -np.inf)
            top = scores.max(axis=1, keepdims=True)
            if sinks is not None:
                top = np.maximum(top, np.float32(sinks[h]))
            p = np.exp(scores - top)
            total = p.sum(axis=1, keepdims=True)
            if sinks is not None:
                total = total + np.exp(np.float32(sinks[h]) - top)
            p /= total
            out[q0:q1, h, :] = p @ values[:, kh, :]
    return hadamard(out, value_rotation(q.shape[2])) if v_cache.dtype == np.int8 else out
