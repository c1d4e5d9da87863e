"""The backend interface: the few operations a model's forward pass needs.

A model module calls only these (plus reshapes), so the same architecture file runs on the NumPy
reference, the Numba CPU kernels, or a PyTorch device.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    name: str

    def prepare_weight(self, raw: np.ndarray, ggml_type: int) -> Any:
        """Take a tensor as stored in the GGUF (possibly repacking it once) for `linear`/`embedding`."""

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> Any:
        """A small 1-D tensor (norm weight, bias) as float32."""

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> Any:
        """Key and value pools: (n_layers, num_blocks, block_size, kv_heads, head_dim) each."""

    def linear(self, x: Any, weight: Any) -> Any:
        """x (T, K) times the (N, K) weight transposed -> (T, N)."""

    def linear_precise(self, x: Any, weight: Any) -> Any:
        """linear for projections sensitive to activation rounding (the output projection)."""

    def linear_many(self, x: Any, weights: Any) -> list[Any]:
        """[linear(x, w) for w in weights] for weights sharing their input (q/k/v, gate/up); a backend
        may fuse them into one pass."""

    def embedding(self, weight: Any, ids: Any) -> Any: ...

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...

    def rope(self, x: Any, positions: Any, rope_dim: int, base: float, neox: bool) -> Any: ...

    def swiglu(self, gate: Any, up: Any) -> Any: ...

    def geglu(self, gate: Any, up: Any) -> Any: ...

    def store_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any) -> None: ...

    def rope_store_kv(
        self,
        q: Any,
        k: Any,
        v: Any,
        positions: Any,
        rope_dim: int,
        base: float,
        neox: bool,
        k_cache: Any,
        v_cache: Any,
        slot_mapping: Any,
    ) -> tuple[Any, Any]:
        """(rope(q), rope(k)), with rotated k and v written to the cache at slot_mapping."""

    def paged_attention(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        query_start_loc: Any,
        context_lens: Any,
        block_tables: Any,
        scale: float,
        sliding_window: int = 0,
    ) -> Any: ...

    def to_numpy(self, x: Any) -> np.ndarray: ...
