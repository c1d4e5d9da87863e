"""The NumPy reference backend: slow, simple, and the oracle the fast backends are compared with.

Loading keeps weights quantized (memory-mapped); each matrix is dequantized to float32 the first time
`linear` uses it and kept, so a long generation does not redo it every token. That makes resident memory
about 4x the file once every layer has run: fine for an oracle, which is all this backend is for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.kernels import reference as ref
from localllm.quant import dequantize


@dataclass(slots=True)
class RawWeight:
    raw: np.ndarray
    ggml_type: int
    dense: np.ndarray | None = None  # (N, K) float32, filled on first use

    def dequantized(self) -> np.ndarray:
        if self.dense is None:
            self.dense = dequantize(self.raw, self.ggml_type)
        return self.dense


class NumpyBackend:
    name = "numpy"

    def prepare_weight(self, raw: np.ndarray, ggml_type: int) -> RawWeight:
        return RawWeight(raw, ggml_type)

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> np.ndarray:
        return np.ascontiguousarray(dequantize(raw, ggml_type), dtype=np.float32).reshape(-1)

    def allocate_kv(self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
        shape = (n_layers, num_blocks, block_size, kv_heads, head_dim)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def linear(self, x: np.ndarray, weight: RawWeight) -> np.ndarray:
        return x.astype(np.float32) @ weight.dequantized().T

    def linear_precise(self, x: np.ndarray, weight: RawWeight) -> np.ndarray:
        return self.linear(x, weight)

    def linear_many(self, x: np.ndarray, weights: list[RawWeight]) -> list[np.ndarray]:
        return [self.linear(x, w) for w in weights]

    def rope_store_kv(self, q, k, v, positions, rope_dim, base, neox, k_cache, v_cache, slot_mapping):
        q, k = ref.rope(q, positions, rope_dim, base, neox), ref.rope(k, positions, rope_dim, base, neox)
        ref.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, k

    def embedding(self, weight: RawWeight, ids: np.ndarray) -> np.ndarray:
        return ref.embedding(weight.raw, weight.ggml_type, ids)

    rms_norm = staticmethod(ref.rms_norm)
    rope = staticmethod(ref.rope)
    swiglu = staticmethod(ref.swiglu)
    geglu = staticmethod(ref.geglu)
    store_kv = staticmethod(ref.store_kv)
    paged_attention = staticmethod(ref.paged_attention)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x
