"""The physical KV pool: one array of blocks per layer for keys and one for values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.models.spec import ModelArgs

# KV cache element types by llama.cpp's names (--cache-type-k/-v) -> bytes per element. f16 is the
# default, as in llama.cpp: half the memory of f32, and attention reads half the bytes.
CACHE_TYPE_BYTES = {"f32": 4, "f16": 2}
DEFAULT_CACHE_TYPE = "f16"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's keys and values are in a model's cache: layers, heads, width, element types."""

    n_layers: int
    kv_heads: int
    head_dim: int
    cache_types: tuple[str, str] = (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE)
    # (kv heads, head dim) of each layer where they differ between layers (gemma4), else ()
    layer_shapes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(
        cls, args: ModelArgs, cache_types: tuple[str, str] = (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE)
    ) -> KVLayout:
        """The layout of a model's (ModelArgs') cache in the given element types."""
        kvh, hd = args.kv_row_shape()
        shapes = tuple((args.kv_heads_of(il), args.head_dim_of(il)) for il in range(args.n_layers))
        uniform = all(s == (kvh, hd) for s in shapes)
        return cls(args.n_layers, kvh, hd, cache_types, () if uniform else shapes)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across all layers."""
        per_row = self.n_layers * self.kv_heads * self.head_dim
        return per_row * (CACHE_TYPE_BYTES[self.cache_types[0]] + CACHE_TYPE_BYTES[self.cache_types[1]])


class KVCache:
    def __init__(self, backend: Backend, layout: KVLayout, num_blocks: int, block_size: int):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache_types = layout.cache_types
        self.backend = backend
        # (n_layers, num_blocks, block_size, kv_heads, head_dim) each
        self.k, self.v = backend.allocate_kv(
            layout.n_layers, num_blocks, block_size, layout.kv_heads, layout.head_dim, layout.cache_types
        )

    def layer(self, il: int) -> tuple[Any, Any]:
        """Layer il's keys and values as (blocks, block_size, kv heads, head dim). A layer narrower
        than the pool's rows sees its slab as more, smaller blocks, of which it uses every
        (row / its row)-th: pool block b is its block b * factor (see ModelArgs.kv_block_factor)."""
        k, v = self.k[il], self.v[il]
        if not self.layout.layer_shapes:
            return k, v
        kvh, hd = self.layout.layer_shapes[il]
        shape = (-1, self.block_size, kvh, hd)
        return k.reshape(shape), v.reshape(shape)

    def read_block(self, block_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of one block's keys and values, every layer's, in the pool's element types."""
        return self.backend.kv_block_to_host(self.k, block_id), self.backend.kv_block_to_host(
            self.v, block_id
        )

    def write_block(self, block_id: int, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite one block's keys and values, as read_block gave them."""
        self.backend.kv_block_from_host(self.k, block_id, k)
        self.backend.kv_block_from_host(self.v, block_id, v)
