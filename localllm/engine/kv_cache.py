"""The physical KV pool: one array of blocks per layer for keys and one for values."""

from __future__ import annotations

from typing import Any


class KVCache:
    def __init__(
        self, backend: Any, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # (n_layers, num_blocks, block_size, kv_heads, head_dim) each
        self.k, self.v = backend.allocate_kv(n_layers, num_blocks, block_size, kv_heads, head_dim)

    def layer(self, il: int) -> tuple[Any, Any]:
        return self.k[il], self.v[il]
