"""What every architecture shares: hyper-parameters read from GGUF metadata, the forward batch, loading."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.models.spec import LayerSpec, ModelArgs, RopeSpec  # noqa: F401 (ModelArgs re-exported)

if TYPE_CHECKING:
    from localllm.gguf_file import GGUFFile


@dataclass(frozen=True, slots=True)
class Hyper:
    """The hyper-parameters every architecture stores under `<arch>.*`."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    context_length: int


def read_hyper(gf: GGUFFile) -> Hyper:
    n_heads = int(_need(gf, "attention.head_count"))
    dim = int(_need(gf, "embedding_length"))
    if n_heads <= 0:
        raise ModelFormatError(f"{gf.path.name}: '{gf.architecture}.attention.head_count' must be positive")
    vocab = gf.arch_get("vocab_size") or len(gf.get("tokenizer.ggml.tokens", []))
    embd = gf.tensors.get("token_embd.weight")
    return Hyper(
        vocab_size=int(vocab or (embd.shape[0] if embd else 0)),
        dim=dim,
        n_layers=int(_need(gf, "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(gf.arch_get("attention.head_count_kv", n_heads)),
        head_dim=int(gf.arch_get("attention.key_length", dim // n_heads)),
        ffn_dim=int(_need(gf, "feed_forward_length")),
        norm_eps=float(gf.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(gf.arch_get("context_length", 2048)),
    )


def read_rope(gf: GGUFFile, h: Hyper, neox: bool, base: float | None = None) -> RopeSpec:
    """The file's rotation; `base` overrides rope.freq_base. Linear scaling is honoured; other kinds
    (YaRN, LongRoPE) are refused rather than run without them."""
    kind = str(gf.arch_get("rope.scaling.type", "none"))
    factor = float(gf.arch_get("rope.scaling.factor", 1.0) or 1.0)
    if kind not in ("none", "linear") and factor != 1.0:
        raise ModelFormatError(
            f"{gf.path.name} uses '{kind}' RoPE scaling ({gf.architecture}.rope.scaling.type), "
            "which localllm does not support yet"
        )
    return RopeSpec(
        dim=int(gf.arch_get("rope.dimension_count", h.head_dim)),
        base=float(base if base is not None else gf.arch_get("rope.freq_base", 10000.0)),
        freq_scale=1.0 / factor if kind == "linear" else 1.0,
        neox=neox,
    )


def make_args(gf: GGUFFile, h: Hyper, layers: list[LayerSpec], **model_fields: Any) -> ModelArgs:
    """ModelArgs from the shared hyper-parameters, one spec per layer and model-level fields."""
    if len(layers) != h.n_layers:
        raise ValueError("one LayerSpec per layer")
    return ModelArgs(
        architecture=gf.architecture,
        **{f: getattr(h, f) for f in Hyper.__slots__},
        attn_scale=1.0 / math.sqrt(h.head_dim) if h.head_dim > 0 else 1.0,
        layers=tuple(layers),
        tied_output="output.weight" not in gf.tensors,
        **model_fields,
    )


def has_layer_tensor(gf: GGUFFile, il: int, name: str) -> bool:
    """Whether layer il carries an optional tensor (biases, q/k norms) that llama-family files may have."""
    return f"blk.{il}.{name}.weight" in gf.tensors or f"blk.{il}.{name}" in gf.tensors


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

    def matrix(self, name: str) -> Any:
        return self.backend.prepare_weight(self.gf.raw(self._checked(name)), self.gf.tensors[name].ggml_type)

    def vector(self, name: str) -> Any:
        return self.backend.prepare_vector(self.gf.raw(self._checked(name)), self.gf.tensors[name].ggml_type)

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
