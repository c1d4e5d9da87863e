"""The NumPy reference backend: slow, simple, and the oracle the fast backends are compared with.

Loading keeps weights quantized (memory-mapped); each matrix is dequantized to float32 the first time
`linear` uses it and kept, so a long generation does not redo it every token. That makes resident memory
about 4x the file once every layer has run: fine for an oracle, which is all this backend is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.backends.base import Backend
from localllm.backends.kv_types import row_width
from localllm.backends.memory import lazy_zeros
from localllm.kernels import gated_delta_reference, moe_reference
from localllm.kernels import reference as ref
from localllm.quant import dequantize

if TYPE_CHECKING:
    from localllm.models.layers import LayerWeights
    from localllm.models.spec import LayerSpec

_KV_STORAGE = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}


@dataclass(slots=True)
class RawWeight:
    raw: np.ndarray
    ggml_type: int
    dense: np.ndarray | None = None  # (N, K) float32, filled on first use

    def dequantized(self) -> np.ndarray:
        if self.dense is None:
            self.dense = dequantize(self.raw, self.ggml_type)
        return self.dense


class NumpyBackend(Backend):
    name = "numpy"

    def prepare_weight(self, raw: np.ndarray, ggml_type: int, cache: Any = None) -> RawWeight:
        return RawWeight(raw, ggml_type)

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> np.ndarray:
        return np.ascontiguousarray(dequantize(raw, ggml_type), dtype=np.float32).reshape(-1)

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """q8_0 as ggml's block bytes in int8, as the Numba backend stores it (reference.to_storage)."""
        shape = (n_layers, num_blocks, block_size, kv_heads)
        k, v = (lazy_zeros((*shape, row_width(t, head_dim)), _KV_STORAGE[t]) for t in cache_types)
        return k, v

    # True: every matmul input rounded as the Numba integer path rounds it (reference.rounded_activations),
    # a twin of that path's 8-bit rounding (the conformance tests measure its effect on routing).
    round_activations = False

    def linear(self, x: np.ndarray, weight: RawWeight) -> np.ndarray:
        x = x.astype(np.float32)
        x = ref.rounded_activations(x, weight.ggml_type) if self.round_activations else x
        return x @ weight.dequantized().T

    def rope_store_kv(self, q, k, v, positions, rope: Any, k_cache, v_cache, slot_mapping):
        args = (positions, rope.dim, rope.base, rope.neox, rope.freq_scale, rope.frequencies(), rope.mscale())
        q, k = ref.rope(q, *args), ref.rope(k, *args)
        ref.store_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, k

    def embedding(self, weight: RawWeight, ids: np.ndarray) -> np.ndarray:
        return ref.embedding(weight.raw, weight.ggml_type, ids)

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return np.float32(cap) * np.tanh(x / np.float32(cap))

    rms_norm = staticmethod(ref.rms_norm)
    swiglu = staticmethod(ref.swiglu)
    geglu = staticmethod(ref.geglu)
    swiglu_oai = staticmethod(ref.swiglu_oai)
    paged_attention = staticmethod(ref.paged_attention)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    runs_moe = True

    def moe_ffn(self, h: np.ndarray, lw: LayerWeights, spec: LayerSpec, router_in: Any = None) -> np.ndarray:
        def expert(e: int) -> tuple[np.ndarray, ...]:
            return tuple(w[e].dequantized() for w in (lw.gate_exps, lw.up_exps, lw.down_exps))

        def biases(e: int) -> tuple[np.ndarray, ...]:
            return tuple(b[e] for b in (lw.gate_exps_b, lw.up_exps_b, lw.down_exps_b))

        x, router = h.astype(np.float32), lw.router.dequantized()
        return moe_reference.moe_ffn(
            x, router, expert, spec.experts_used, spec.expert_renorm, biases if spec.expert_bias else None,
            lw.router_b if spec.router_bias else None, spec.activation,
            None if router_in is None else router_in.astype(np.float32),
            lw.down_exps_s if spec.expert_scale else None,
            (lw.gate_exps[0].ggml_type, lw.down_exps[0].ggml_type) if self.round_activations else None,
        )  # fmt: skip

    def sigmoid_gate(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return moe_reference.sigmoid_gate(h.astype(np.float32), weight)

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return (x / (np.float32(1.0) + np.exp(-gate))).astype(np.float32)

    runs_gated_delta = True

    def gated_delta(self, qkv, z, beta, alpha, lw, spec, batch, conv_state, ssm_state, eps):
        """kernels/gated_delta_reference.mixer: a prefill chunk in the chunkwise form."""
        return gated_delta_reference.mixer(
            qkv, z, beta, alpha, lw.ssm_conv.reshape(-1, spec.ssm_conv), lw.ssm_dt, lw.ssm_a, lw.ssm_norm,
            batch.query_start_loc, batch.positions, batch.state_slots, conv_state, ssm_state,
            spec.ssm_k_heads, spec.ssm_interleaved, eps,
        )  # fmt: skip
