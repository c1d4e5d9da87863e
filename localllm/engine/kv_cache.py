"""The physical KV pool: one array of blocks per layer for keys and one for values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.backends.kv_types import CACHE_TYPE_BLOCKS, check_cache_type, row_bytes
from localllm.backends.memory import populate
from localllm.errors import ConfigError

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.models.spec import ModelArgs

# KV cache element types by llama.cpp's names (--cache-type-k/-v) -> bytes per element (q8_0: 34 per
# 32). f16 is the default, as in llama.cpp: half the memory of f32, and attention reads half the bytes.
CACHE_TYPE_BYTES = {name: nbytes / values for name, (values, nbytes) in CACHE_TYPE_BLOCKS.items()}
DEFAULT_CACHE_TYPE = "f16"
# Blocks made resident together before a restore from disk writes the first of them (see prefault).
PREFAULT_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token's keys and values are in a model's cache: layers, heads, width, element types."""

    n_layers: int
    kv_heads: int
    head_dim: int
    cache_types: tuple[str, str] = (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE)
    # (kv heads, head dim) of each layer where they differ between layers (gemma4), else ()
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for t in self.cache_types:  # q8_0 blocks must tile a head, as llama.cpp requires
            check_cache_type(t, self.head_dim)
        if self.layer_shapes and any(CACHE_TYPE_BLOCKS[t][0] > 1 for t in self.cache_types):
            raise ConfigError(
                "a q8_0 KV cache is not supported for models whose layers differ in head size (gemma4): "
                "use -ctk f16 -ctv f16"
            )

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
        k, v = (row_bytes(t, self.head_dim) for t in self.cache_types)
        return self.n_layers * self.kv_heads * (k + v)


class KVCache:
    def __init__(
        self, backend: Backend, layout: KVLayout, num_blocks: int, block_size: int, states: Any = None
    ):  # fmt: skip
        """states: the recurrent layers' StateCache (state_cache.py), None for a model without."""
        self.states = states
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache_types = layout.cache_types
        self.backend = backend
        # (n_layers, num_blocks, block_size, kv_heads, head_dim) each
        self.k, self.v = backend.allocate_kv(
            layout.n_layers, num_blocks, block_size, layout.kv_heads, layout.head_dim, layout.cache_types
        )
        self.prefault_blocks = PREFAULT_BLOCKS  # 0: off (benchmarks compare)
        self._resident: set[int] = set()  # chunks of prefault_blocks already made resident

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
        """Overwrite one block's keys and values, as read_block gave them (the disk tier's restore)."""
        self.prefault(block_id)
        self.backend.kv_block_from_host(self.k, block_id, k)
        self.backend.kv_block_from_host(self.v, block_id, v)

    def prefault_first(self, num_blocks: int) -> None:
        """prefault() every chunk of the pool's first num_blocks blocks (the disk tier, at start)."""
        for block_id in range(0, num_blocks, max(self.prefault_blocks, 1)):
            self.prefault(block_id)

    def prefault(self, block_id: int) -> None:
        """Make the chunk of prefault_blocks blocks holding block_id resident in every layer, one madvise
        per layer and pool. The pool is mapped lazily (memory.lazy_zeros): a restore writing block by
        block took a page fault per layer and 4 KiB, about half of a restored prompt's time to first
        token; restored blocks are mostly consecutive, so the chunk's next blocks are the next ones
        written. Host (NumPy) pools only."""
        n = self.prefault_blocks
        if n <= 0 or not isinstance(self.k, np.ndarray) or block_id // n in self._resident:
            return
        self._resident.add(block_id // n)
        lo = block_id // n * n
        hi = min(self.num_blocks, lo + n)
        for pool in (self.k, self.v):
            for layer in range(pool.shape[0]):
                populate(pool, layer * pool.strides[0] + lo * pool.strides[1], (hi - lo) * pool.strides[1])
