"""A q8_0 KV cache in torch tensors: ggml's Q8_0 blocks (an f16 scale d = max|x| / 127, then 32 int8
q = roundf(x / d); 34 bytes per 32 values) as an int8 pool row, byte for byte what the Numba and NumPy
back ends store (kernels/reference.to_storage), so a cached block means the same on every back end."""

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
