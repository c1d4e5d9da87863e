"""Reading and writing the paged KV cache in its storage type: float32, or float16 stored as its IEEE
bits in uint16 arrays (Numba has no float16 arrays on the CPU). llama.cpp keeps K and V in f16 by
default: half the memory of f32, and attention reads half the bytes.

`kv_get` and `kv_set_row` are resolved at compile time from the cache array's dtype, so each attention
and store kernel is compiled once per storage type with no per-element branch.
"""

from __future__ import annotations

from numba import types
from numba.extending import overload

from .simd import f16_to_f32, f32_to_f16

# Storage dtypes by llama.cpp's cache-type names.
CACHE_TYPES = {"f32": "float32", "f16": "uint16"}


def kv_get(cache, i, j):
    """cache[i, j] as float32 (cache: 2-D rows of the paged cache)."""


def kv_set_row(cache, blk, off, row):
    """cache[blk, off] = row (kv_heads, head_dim) float32, converted to the storage type."""


def _is_f16(cache) -> bool:
    return isinstance(cache, types.Array) and cache.dtype == types.uint16


@overload(kv_get, inline="always", jit_options={"cache": True})
def _kv_get_impl(cache, i, j):
    if _is_f16(cache):
        return lambda cache, i, j: f16_to_f32(cache[i, j])
    return lambda cache, i, j: cache[i, j]


@overload(kv_set_row, jit_options={"cache": True})
def _kv_set_row_impl(cache, blk, off, row):
    if not _is_f16(cache):

        def copy(cache, blk, off, row):
            cache[blk, off] = row

        return copy

    def convert(cache, blk, off, row):
        for h in range(row.shape[0]):
            for d in range(row.shape[1]):
                cache[blk, off, h, d] = f32_to_f16(row[h, d])

    return convert
