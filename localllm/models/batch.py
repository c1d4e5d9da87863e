"""What one forward pass reads besides the weights: the step's batch as arrays and the paged KV pool.

A leaf module (numpy only), so the backend seam can name these types without importing the models that
name the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(slots=True)
class ForwardBatch:
    """One scheduled step as arrays: T tokens from S sequences (prefill chunks and decodes mixed)."""

    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64: where each token's K/V goes in the paged cache
    query_start_loc: np.ndarray  # (S + 1,) int64
    context_lens: np.ndarray  # (S,) int64: cached positions after this step
    block_tables: np.ndarray  # (S, max_blocks) int64, padded with 0
    logits_indices: np.ndarray  # (L,) int64: rows whose logits are needed
    # (S,) int64: each sequence's slot in the recurrent state pool (models with recurrent layers)
    state_slots: np.ndarray | None = None


class PagedKV(Protocol):
    """The paged KV pool a forward pass writes and attends over (engine/kv_cache.py's KVCache): the
    layers see only this, so models need not import the engine."""

    k: Any  # (n_layers, num_blocks, block_size, kv_heads, head_dim), the backend's array type
    v: Any
    num_blocks: int
    block_size: int
    states: Any  # the recurrent layers' state pool (engine/state_cache.py's StateCache), or None

    def layer(self, il: int) -> tuple[Any, Any]: ...
