"""KV cache element types by llama.cpp's names (--cache-type-k/-v) and how a pool stores each one.

f32 and f16 store one element per head dimension; q8_0 stores ggml's Q8_0 blocks as llama.cpp does:
per 32 values, an f16 scale d = max|x| / 127 then 32 int8 q = round(x / d), 34 bytes in all. A q8_0
pool row is those bytes (an int8 array whose last axis is head_dim / 32 * 34), written by the store
kernels and read by attention one key/value row at a time (kernels/kv.py). Pure arithmetic: the engine,
`info` and the backends share it without importing a kernel.
"""

from __future__ import annotations

from localllm.errors import ConfigError

# (values, bytes) of one storage block of each type
CACHE_TYPE_BLOCKS = {"f32": (1, 4), "f16": (1, 2), "q8_0": (32, 34)}
CACHE_TYPE_NAMES = tuple(CACHE_TYPE_BLOCKS)
Q8_0_VALUES, Q8_0_BYTES = CACHE_TYPE_BLOCKS["q8_0"]


def check_cache_type(cache_type: str, head_dim: int | None = None) -> None:
    """Refuse an unknown type, or a block type whose blocks do not tile the head size (as llama.cpp)."""
    if cache_type not in CACHE_TYPE_BLOCKS:
        choices = ", ".join(CACHE_TYPE_NAMES)
        raise ConfigError(f"KV cache type {cache_type!r} is not supported (choose {choices})")
    values = CACHE_TYPE_BLOCKS[cache_type][0]
    if head_dim is not None and head_dim % values:
        raise ConfigError(
            f"a {cache_type} KV cache needs a head size divisible by {values} (this model has {head_dim})"
        )


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes that `values` elements (a whole number of the type's blocks) take in the pool."""
    per, nbytes = CACHE_TYPE_BLOCKS[cache_type]
    return values // per * nbytes


def row_width(cache_type: str, head_dim: int) -> int:
    """Length of a pool's last axis for one head: head_dim elements, or its bytes for a block type."""
    return row_bytes(cache_type, head_dim) if CACHE_TYPE_BLOCKS[cache_type][0] > 1 else head_dim
