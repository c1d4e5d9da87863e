"""The physical KV pool: one array of blocks per layer for keys and one for values."""

from __future__ import annotations

from typing import Any

# KV cache element types by llama.cpp's names (--cache-type-k/-v) -> bytes per element. f16 is the
# default, as in llama.cpp: half the memory of f32, and attention reads half the bytes.
CACHE_TYPE_BYTES = {"f32": 4, "f16": 2}
DEFAULT_CACHE_TYPE = "f16"


class KVCache:
    def __init__(
        self, backend: Any, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE),
    ):  # fmt: skip
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache_types = cache_types
        # (n_layers, num_blocks, block_size, kv_heads, head_dim) each
        self.k, self.v = backend.allocate_kv(
            n_layers, num_blocks, block_size, kv_heads, head_dim, cache_types
        )

    def layer(self, il: int) -> tuple[Any, Any]:
        return self.k[il], self.v[il]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, cache_types: tuple[str, str]) -> int:
    """Keys and values of one token across all layers."""
    per_row = n_layers * n_kv_heads * head_dim
    return per_row * (CACHE_TYPE_BYTES[cache_types[0]] + CACHE_TYPE_BYTES[cache_types[1]])
