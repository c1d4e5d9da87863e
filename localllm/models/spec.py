"""What a decoder layer computes, as data.

An architecture file reads its hyper-parameters into `ModelArgs`, with one `LayerSpec` per layer, and
names its tensors; everything else (the op-by-op layer in layers.py, the fused Numba stack) reads only
these fields. A field a path cannot execute is refused by that path by name, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (llama, qwen) and GeGLU with tanh-GELU (gemma)


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding: theta_i = pos * freq_scale * base^(-2i / dim) on the first `dim` dims."""

    dim: int
    base: float = 10_000.0
    freq_scale: float = 1.0  # linear position scaling (1 / rope.scaling.factor)
    neox: bool = False  # rotate (i, i + dim/2) pairs instead of adjacent (2i, 2i + 1) ones


@dataclass(frozen=True, slots=True)
class LayerSpec:
    rope: RopeSpec
    window: int = 0  # sliding-window attention over the last `window` positions; 0 = whole context
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # RMSNorm over each head of q and k (gemma3, qwen3)
    post_attn_norm: bool = False  # RMSNorm of the attention output before the residual add (gemma)
    post_ffn_norm: bool = False  # the same after the feed-forward
    activation: str = "silu"
    precise_down: bool = False  # near-float activations for the down projection (GeGLU outliers)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (gemma2); 0 = off

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """A model's hyper-parameters and per-layer specs: all the model code needs besides weights."""

    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    context_length: int
    attn_scale: float
    layers: tuple[LayerSpec, ...]
    embedding_scale: float = 1.0  # gemma multiplies embeddings by sqrt(dim)
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (gemma2); 0 = off
    tied_output: bool = False  # the output projection reuses token_embd (no output.weight)

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 keys and values for every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4

    @property
    def rope(self) -> RopeSpec:
        """The first layer's rotation (for display; layers may differ)."""
        return self.layers[0].rope


def spec_fields(spec: LayerSpec) -> dict[str, object]:
    """The spec as a flat name -> value dict (rope fields as rope.<name>)."""
    out: dict[str, object] = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, RopeSpec):
            out.update({f"rope.{g.name}": getattr(value, g.name) for g in fields(value)})
        else:
            out[f.name] = value
    return out
