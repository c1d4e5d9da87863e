"""Reading and writing the paged KV cache in its storage type: float32, float16 stored as its IEEE
bits in uint16 arrays (Numba has no float16 arrays on the CPU), or ggml's Q8_0 blocks as int8 bytes
(34 per 32 values: an f16 scale, then 32 signed quants; backends/kv_types.py). llama.cpp keeps K and V
in f16 by default: half the memory of f32, and attention reads half the bytes; q8_0 about half again.

`kv_get`, `kv_row` and `kv_set_row` are resolved at compile time from the cache array's dtype, so each
attention and store kernel is compiled once per storage type with no per-element branch. Attention
reads a q8_0 value row through `kv_row`, which dequantizes that one row into a small buffer (never a
float copy of the cache); q8_0 keys are scored in their own bytes (attention_q8.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .kv_rotation import fwht
from .simd import f16_to_f32, f32, f32_to_f16, i32
from .simd_i8 import scale_i8x32

# Storage dtypes by llama.cpp's cache-type names.
CACHE_TYPES = {"f32": "float32", "f16": "uint16", "q8_0": "int8"}
Q8_VALUES, Q8_BYTES = 32, 34  # ggml's QK8_0 and sizeof(block_q8_0)


def kv_get(row, j):
    """row[j] as float32 (row: one row of the paged cache as kv_row gives it)."""


def kv_row(cache, i, buf):
    """Row i of the 2-D cache rows, readable with kv_get: the row itself (f32, f16), or for q8_0 the
    row dequantized into buf (head_dim float32), which is returned."""


def kv_set_row(cache, blk, off, row, rot):
    """cache[blk, off] = row (kv_heads, head_dim) float32, converted to the storage type; a q8_0 row
    each head rotated first by H of size rot when rot > 0 (kv_rotation.py; other types ignore rot)."""


def _is_f16(cache) -> bool:
    return isinstance(cache, types.Array) and cache.dtype == types.uint16


def _is_q8(cache) -> bool:
    return isinstance(cache, types.Array) and cache.dtype == types.int8


@overload(kv_get, inline="always", jit_options={"cache": True})
def _kv_get_impl(row, j):
    if _is_f16(row):
        return lambda row, j: f16_to_f32(row[j])
    return lambda row, j: row[j]


@njit(cache=True, error_model="numpy")
def q8_quantize_row(x, raw) -> None:
    """raw = x (n,) as Q8_0 blocks, ggml's quantize_row_q8_0_ref: d = max|x| / 127 (stored as f16),
    q = roundf(x * (1 / d)) with halves away from zero (no fastmath: the bits match quant/'s NumPy)."""
    for b in range(x.shape[0] // Q8_VALUES):
        amax = f32(0.0)
        for j in range(Q8_VALUES):
            amax = max(amax, abs(x[b * Q8_VALUES + j]))
        d = amax / f32(127.0)
        inv = f32(1.0) / d if d != 0 else f32(0.0)
        o = b * Q8_BYTES
        bits = i32(f32_to_f16(d))
        raw[o], raw[o + 1] = np.int8(np.uint8(bits & 0xFF)), np.int8(np.uint8(bits >> 8))
        for j in range(Q8_VALUES):
            v = x[b * Q8_VALUES + j] * inv
            a = abs(v)
            whole = np.floor(a)
            r = whole + f32(1.0) if a - whole >= f32(0.5) else whole
            raw[o + 2 + j] = np.int8(-r if v < 0 else r)


@overload(kv_row, inline="always", jit_options={"cache": True})
def _kv_row_impl(cache, i, buf):
    if _is_q8(cache):

        def dequantized(cache, i, buf):  # flat indices: a row view would cost two atomic refcounts
            w = cache.shape[1]
            for b in range(buf.shape[0] // Q8_VALUES):
                o = b * Q8_BYTES
                d = f16_to_f32((i32(cache[i, o]) & 0xFF) | ((i32(cache[i, o + 1]) & 0xFF) << 8))
                scale_i8x32(cache, i * w + o + 2, d, buf, b * Q8_VALUES)
            return buf

        return dequantized
    return lambda cache, i, buf: cache[i]


@overload(kv_set_row, jit_options={"cache": True})
def _kv_set_row_impl(cache, blk, off, row, rot):
    if _is_q8(cache):

        def quantize(cache, blk, off, row, rot):
            rotated = np.empty(row.shape[1], np.float32)
            for h in range(row.shape[0]):
                if rot > 0:
                    rotated[:] = row[h]
                    fwht(rotated, rot)
                    q8_quantize_row(rotated, cache[blk, off, h])
                else:
                    q8_quantize_row(row[h], cache[blk, off, h])

        return quantize
    if not _is_f16(cache):

        def copy(cache, blk, off, row, rot):
            cache[blk, off] = row

        return copy

    def convert(cache, blk, off, row, rot):
        for h in range(row.shape[0]):
            for d in range(row.shape[1]):
                cache[blk, off, h, d] = f32_to_f16(row[h, d])

    return convert
