"""A q8_0 KV cache in torch tensors: ggml's Q8_0 blocks (an f16 scale d = max|x| / 127, then 32 int8
q = roundf(x / d); 34 bytes per 32 values) as an int8 pool row, byte for byte what the Numba and NumPy
back ends store (kernels/reference.to_storage), so a cached block means the same on every back end.
Like them (kernels/kv_rotation.py, llama.cpp's attn_rot_k / attn_rot_v), a q8_0 cache holds each head's
keys and values rotated by a Walsh-Hadamard matrix: the query is rotated as the keys were, and the
output of attention over rotated values rotated back."""

from __future__ import annotations

import torch

from localllm.backends.kv_types import Q8_0_BYTES, Q8_0_VALUES


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) values -> (..., D / 32 * 34) int8 block bytes, as quant.quantize_legacy.quantize_q8_0."""
    lead, n = x.shape[:-1], x.shape[-1] // Q8_0_VALUES
    blocks = x.float().reshape(*lead, n, Q8_0_VALUES)
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    scaled = blocks * inverse[..., None]
    magnitude = scaled.abs()
    whole = magnitude.floor()  # C's roundf: halves away from zero, exactly
    q = torch.copysign(whole + (magnitude - whole >= 0.5).float(), scaled).to(torch.int8)
    scale_bytes = d.half().unsqueeze(-1).contiguous().view(torch.int8)  # (..., n, 2), little-endian
    return torch.cat([scale_bytes, q], dim=-1).reshape(*lead, n * Q8_0_BYTES)


def dequantize_rows(raw: torch.Tensor) -> torch.Tensor:
    """(..., D / 32 * 34) int8 block bytes -> (..., D) float32 (each value d * q)."""
    lead, n = raw.shape[:-1], raw.shape[-1] // Q8_0_BYTES
    blocks = raw.reshape(*lead, n, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., n, 1)
    return (blocks[..., 2:].float() * d).reshape(*lead, n * Q8_0_VALUES)


def rounded_query(q: torch.Tensor) -> torch.Tensor:
    """q (..., D) as llama.cpp scores it against a q8_0 K cache: rounded to Q8_0 as ggml's AVX2
    quantize_row_q8_0 does (rint(x * 127 / max|x|), an f16 scale max|x| / 127), then the values
    scale * quant (kernels/reference.quantize_query_q8), so the dot equals its integer dots up to
    float32 rounding."""
    lead, n = q.shape[:-1], q.shape[-1] // Q8_0_VALUES
    blocks = q.float().reshape(*lead, n, Q8_0_VALUES)
    amax = blocks.abs().amax(dim=-1)
    inverse = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, 1.0), 0.0)
    quants = torch.round(blocks * inverse[..., None])  # (halves to even, as rint)
    scale = (amax / 127.0).half().float()
    return (quants * scale[..., None]).reshape(q.shape)


ROTATION_UNIT = 64  # as kernels/kv_rotation.py: heads this divides are rotated


def key_rotation(head_dim: int) -> int:
    """The Hadamard size for a q8_0 K cache's heads: the largest power of two dividing head_dim, from
    64 up; 0 (no rotation) when 64 does not divide it."""
    if head_dim % ROTATION_UNIT:
        return 0
    n = ROTATION_UNIT
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def value_rotation(head_dim: int) -> int:
    return ROTATION_UNIT if head_dim % ROTATION_UNIT == 0 else 0


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., D) float32 with each n-chunk of the last axis times the orthonormal H_n, in ggml's order
    (scale by 1 / sqrt(n), then butterflies u + v, u - v of span 1, 2, ... n / 2): the same float32
    operations as kernels/kv_rotation.fwht, so the stored bytes match the other back ends'. x when n is 0."""
    if not n:
        return x
    lead = (*x.shape[:-1], x.shape[-1] // n)
    scale = torch.tensor(1.0, dtype=torch.float32) / torch.sqrt(torch.tensor(float(n), dtype=torch.float32))
    y = x.float().reshape(*lead, n) * scale.to(x.device)
    span = 1
    while span < n:
        y = y.reshape(*lead, n // (2 * span), 2, span)
        u, v = y[..., 0, :], y[..., 1, :]
        y = torch.stack([u + v, u - v], dim=-2)
        span *= 2
    return y.reshape(x.shape)
