"""llama.cpp's Hadamard rotation of a quantized KV cache (llama-kv-cache.cpp: attn_rot_k, attn_rot_v).

With a quantized K cache and a head size divisible by 64, llama.cpp multiplies each head's query and key
by an orthonormal Walsh-Hadamard matrix H (of the largest power of two dividing the head size, applied
to each such chunk of the head) before the key is stored: q . k is unchanged (H is orthonormal), but an
outlier dimension, as Qwen2's keys have, is spread over its chunk, so a 32-value q8_0 block no longer
rounds the rest of the block to one coarse step. With a quantized V cache each value is rotated by H of
size 64, and attention's output back (H is symmetric: H H = I). Without it, Qwen2.5-Coder-0.5B's first
greedy token after "The capital of France is" lost 4.9 logits with -ctk q8_0 (llama.cpp's: 0.07).
The arithmetic is ggml's CPU fwht: the chunk times 1 / sqrt(n), then in-place butterflies (u + v,
u - v) of span 1, 2, 4, ... n / 2. LLAMA_ATTN_ROT_DISABLE turns it off in llama.cpp; not here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .simd import f32

ROTATION_UNIT = 64  # llama.cpp rotates heads whose size this divides; V always in chunks of it


@njit(cache=True)
def key_rotation(head_dim: int) -> int:
    """The rotation's size for a quantized K cache's heads of head_dim: 0 (none) unless 64 divides it."""
    if head_dim % ROTATION_UNIT:
        return 0
    n = ROTATION_UNIT
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


@njit(cache=True)
def value_rotation(head_dim: int) -> int:
    return ROTATION_UNIT if head_dim % ROTATION_UNIT == 0 else 0


@njit(cache=True, error_model="numpy")
def fwht(x, n) -> None:
    """x (1-D, a multiple of n long) <- each n-chunk times H_n, in ggml's order (no fastmath: its bits)."""
    scale = f32(1.0) / np.sqrt(f32(n))
    for i in range(x.shape[0]):
        x[i] = x[i] * scale
    for o in range(0, x.shape[0], n):
        span = 1
        while span < n:
            for i in range(o, o + n, 2 * span):
                for j in range(i, i + span):
                    u, v = x[j], x[j + span]
                    x[j] = u + v
                    x[j + span] = u - v
            span *= 2
