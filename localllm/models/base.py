"""What every architecture shares: hyper-parameters read from GGUF metadata, the forward batch, loading."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.gguf_file import GGUFFile


@dataclass(frozen=True, slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool
    context_length: int
    attn_scale: float
    rope_base_local: float = 0.0  # for sliding-window layers; 0 = same as rope_base
    sliding_window: int = 0  # 0 = every layer attends to the whole context
    sliding_pattern: int = 0  # every `sliding_pattern`-th layer is global, the rest use the window
    embedding_scale: float = 1.0

    def layer_window(self, il: int) -> int:
        if self.sliding_window and self.sliding_pattern and (il + 1) % self.sliding_pattern != 0:
            return self.sliding_window
        return 0

    def layer_rope_base(self, il: int) -> float:
        return self.rope_base_local if self.layer_window(il) and self.rope_base_local else self.rope_base

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 keys and values for every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


def read_args(gf: GGUFFile, rope_neox: bool, **overrides: Any) -> ModelArgs:
    """The hyper-parameters every architecture stores under `<arch>.*`."""
    n_heads = int(_need(gf, "attention.head_count"))
    dim = int(_need(gf, "embedding_length"))
    head_dim = int(gf.arch_get("attention.key_length", dim // n_heads))
    vocab = gf.arch_get("vocab_size") or len(gf.get("tokenizer.ggml.tokens", []))
    values: dict[str, Any] = dict(
        architecture=gf.architecture,
        vocab_size=int(vocab or gf.tensors["token_embd.weight"].shape[0]),
        dim=dim,
        n_layers=int(_need(gf, "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(gf.arch_get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(_need(gf, "feed_forward_length")),
        norm_eps=float(gf.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(gf.arch_get("rope.freq_base", 10000.0)),
        rope_dim=int(gf.arch_get("rope.dimension_count", head_dim)),
        rope_neox=rope_neox,
        context_length=int(gf.arch_get("context_length", 2048)),
        attn_scale=1.0 / math.sqrt(head_dim),
    )
    values.update(overrides)
    return ModelArgs(**values)


def _need(gf: GGUFFile, key: str) -> Any:
    value = gf.arch_get(key)
    if value is None:
        raise ModelFormatError(f"{gf.path.name} lacks the metadata key '{gf.architecture}.{key}'")
    return value


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


class WeightLoader:
    """Reads named tensors from a GGUF through a backend, checking that their types are supported."""

    def __init__(self, gf: GGUFFile, backend: Any):
        self.gf = gf
        self.backend = backend

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def matrix(self, name: str) -> Any:
        return self.backend.prepare_weight(self.gf.raw(self._checked(name)), self.gf.tensors[name].ggml_type)

    def vector(self, name: str) -> Any:
        return self.backend.prepare_vector(self.gf.raw(self._checked(name)), self.gf.tensors[name].ggml_type)

    def optional_vector(self, name: str) -> Any:
        return self.vector(name) if self.has(name) else None

    def _checked(self, name: str) -> str:
        from localllm.quant import is_supported, type_name

        if name not in self.gf.tensors:
            raise ModelFormatError(f"{self.gf.path.name} lacks the tensor '{name}'")
        ggml_type = self.gf.tensors[name].ggml_type
        if not is_supported(ggml_type):
            raise ModelFormatError(
                f"tensor '{name}' in {self.gf.path.name} uses type {type_name(ggml_type)}, "
                "which localllm does not support"
            )
        return name
