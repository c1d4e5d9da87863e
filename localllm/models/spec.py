"""What a decoder layer computes, as data.

An architecture file reads its hyper-parameters into `ModelArgs`, with one `LayerSpec` per layer, and
names its tensors; everything else (the op-by-op layer in layers.py, the fused Numba stack) reads only
these fields. A field a path cannot execute is refused by that path by name, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

# SwiGLU (llama, qwen), GeGLU with tanh-GELU (gemma), and gpt-oss's clamped SwiGLU: with g = min(gate,
# OAI_LIMIT) and u = clip(up, -OAI_LIMIT, OAI_LIMIT), g * sigmoid(OAI_ALPHA * g) * (u + 1) (llama.cpp's
# swiglu_oai, whose constants are fixed in its code, not read from the file)
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0
# What mixes tokens in a layer: softmax attention over the paged KV cache, or a recurrent mixer whose
# per-sequence state lives in the engine's state pool (engine/state_cache.py)
MIXERS = ("attention", "gated_delta_net")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding on the first `dim` dims: pair i turns by pos * frequencies()[i] and is scaled
    by mscale(), as llama.cpp's ggml_rope_ext computes them (see `frequencies`). dim 0 rotates nothing
    (NO_ROPE: SmolLM3's NoPE layers)."""

    dim: int
    base: float = 10_000.0
    freq_scale: float = 1.0  # position scaling (1 / rope.scaling.factor): linear, and YaRN's interpolation
    neox: bool = False  # rotate (i, i + dim/2) pairs instead of adjacent (2i, 2i + 1) ones
    factors: tuple[float, ...] = ()  # per-pair frequency divisors (Llama 3 rope_freqs, Phi-3 LongRoPE)
    attn_factor: float = 1.0  # cos/sin multiplier (rope.scaling.attn_factor)
    yarn_orig_ctx: int = 0  # YaRN (0 = off): the trained context its correction dims are measured in
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0  # YaRN's mscale_all_dim (rope.scaling.yarn_log_multiplier, mistral3); 0 = off

    def frequencies(self) -> np.ndarray:
        """(dim // 2,) float64 angular speed of each pair: freq_scale * base^(-2i/dim) / factors[i];
        with YaRN the low pairs (fast rotations) keep their unscaled speed, blended by a linear ramp
        between the correction dims."""
        i = np.arange(self.dim // 2, dtype=np.float64)
        extrap = self.base ** (-2.0 * i / self.dim)
        if self.factors:
            extrap = extrap / np.asarray(self.factors, np.float64)
        if not self.yarn_orig_ctx:
            return self.freq_scale * extrap
        low, high = self._yarn_corr_dims()
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        return self.freq_scale * extrap * (1.0 - ramp) + extrap * ramp

    def mscale(self) -> float:
        """The cos/sin magnitude: YaRN's 1 + 0.1 ln(1 / freq_scale), times attn_factor; with a log
        multiplier m, divided by 1 + 0.1 m ln(1 / freq_scale) (llama.cpp's yarn_attn_factor)."""
        if self.yarn_orig_ctx and self.freq_scale < 1.0:
            log_factor = math.log(1.0 / self.freq_scale)
            return self.attn_factor * (1.0 + 0.1 * log_factor) / (1.0 + 0.1 * self.yarn_log_mul * log_factor)
        return self.attn_factor

    def _yarn_corr_dims(self) -> tuple[float, float]:
        def corr(rotations: float) -> float:
            turns = self.yarn_orig_ctx / (rotations * 2 * math.pi)
            return self.dim * math.log(turns) / (2 * math.log(self.base))

        low, high = math.floor(corr(self.yarn_beta_fast)), math.ceil(corr(self.yarn_beta_slow))
        return max(0.0, low), min(self.dim - 1.0, high)


NO_ROPE = RopeSpec(dim=0)  # a layer whose q and k are not rotated


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
    # Attention temperature (mistral3, Llama 4): rotated q times 1 + attn_temp_scale * ln(floor(pos /
    # attn_temp_length) + 1), so positions past each attn_temp_length tokens attend more sharply; 0 = off
    attn_temp_scale: float = 0.0
    attn_temp_length: int = 0
    v_from_k: bool = False  # no attn_v: v is the k projection, before k's norm and rotation (gemma4)
    v_norm: bool = False  # RMSNorm without a weight over each head of v (gemma4)
    out_scale: float = 1.0  # the layer's output (the residual stream) times this (gemma4's layer scalar)
    # Mixture of experts (0 experts: the dense gate/up/down FFN). Each token's router softmax picks
    # `experts_used` experts; their outputs are summed with the picked probabilities, renormalised to
    # sum 1 where `expert_renorm` (mixtral, qwen3moe), as they are (qwen2moe) otherwise.
    experts: int = 0
    experts_used: int = 0
    expert_ffn_dim: int = 0  # each expert's hidden width
    expert_renorm: bool = False
    shared_expert: bool = False  # plus the dense FFN (ffn_*_shexp) under a sigmoid gate (qwen2moe)
    # gemma4 (26B-A4B): the dense FFN (ffn_norm in, post_ffw_norm_1 out) plus the experts (pre_ffw_norm_2
    # in, post_ffw_norm_2 out), both reading the attention block's output; the router reads that output
    # RMS-normed without a weight, times ffn_gate_inp.scale / sqrt(dim)
    parallel_experts: bool = False
    expert_scale: bool = False  # each expert's down output times its ffn_down_exps.scale entry (gemma4)
    # gpt-oss: a learned logit per head joins each softmax's denominator (attention sinks: a query may
    # attend to "nothing"); biases on the output projection, the router's logits and every expert's
    # gate/up/down outputs.  (Its top-k softmax over the chosen logits is expert_renorm: the same weights.)
    attn_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # Per-layer sizes (gemma4: sliding and full layers differ; 0 = the model's): each head's width, the
    # KV heads, the dense FFN's width; kv_source >= 0: the layer stores no K/V and attends the cache of
    # that earlier layer (gemma4's KV sharing)
    head_dim: int = 0
    kv_heads: int = 0
    ffn_dim: int = 0
    kv_source: int = -1
    mixer: str = "attention"  # one of MIXERS
    attn_gate: bool = False  # q's projection also gives a per-head gate: out *= sigmoid(gate) (qwen35)
    # Gated DeltaNet (mixer "gated_delta_net", kernels/gated_delta.py): a causal conv of ssm_conv taps
    # over q/k/v, then the gated delta rule with ssm_k_heads key and ssm_v_heads value heads, each
    # ssm_head_dim wide; value head h reads key head h // (v/k) where ssm_interleaved, else h % k
    ssm_conv: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    ssm_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")
        if self.attn_temp_scale and self.attn_temp_length <= 0:
            raise ValueError("an attention temperature needs a positive attn_temp_length")
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer '{self.mixer}' is not one of {', '.join(MIXERS)}")
        if self.mixer == "gated_delta_net" and not (
            self.ssm_conv > 0 and self.ssm_head_dim > 0 and 0 < self.ssm_k_heads <= self.ssm_v_heads
            and self.ssm_v_heads % self.ssm_k_heads == 0
        ):  # fmt: skip
            raise ValueError(
                f"a gated_delta_net layer needs conv taps, a head dim and value heads a multiple of key "
                f"heads (conv {self.ssm_conv}, {self.ssm_k_heads} key / {self.ssm_v_heads} value heads)"
            )
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError(f"{self.experts_used} experts used per token of {self.experts}")
        if (self.parallel_experts or self.expert_scale) and not self.experts:
            raise ValueError("parallel_experts and expert_scale need a mixture-of-experts layer")

    @property
    def recurrent(self) -> bool:
        """Whether the layer keeps a per-sequence state (rather than, or besides, KV)."""
        return self.mixer != "attention"

    def state_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The per-sequence state tensors of this layer as (name, shape), float32; () for attention.
        The engine's state pool holds one of each per sequence (engine/state_cache.py)."""
        if self.mixer != "gated_delta_net":
            return ()
        channels = (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim
        d = self.ssm_head_dim
        return (("conv", (self.ssm_conv - 1, channels)), ("ssm", (self.ssm_v_heads, d, d)))

    @property
    def dense_ffn(self) -> bool:
        """Whether the layer runs the dense gate/up/down FFN (alone, beside or as a shared expert)."""
        return not self.experts or self.shared_expert or self.parallel_experts


def attn_temperature(positions: np.ndarray, scale: float, length: int) -> np.ndarray:
    """(T,) float32 query multipliers of an attention temperature (see LayerSpec.attn_temp_scale),
    computed in float64 and rounded once, as llama.cpp's attn_temp input."""
    steps = np.floor(np.asarray(positions, np.float64) / length)
    return (np.log(steps + 1.0) * scale + 1.0).astype(np.float32)


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


@dataclass(frozen=True, slots=True)
class ModelArgs(Hyper):
    """A model's hyper-parameters and per-layer specs: all the model code needs besides weights."""

    architecture: str
    attn_scale: float
    layers: tuple[LayerSpec, ...]
    embedding_scale: float = 1.0  # gemma multiplies embeddings by sqrt(dim)
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (gemma2); 0 = off
    tied_output: bool = False  # the output projection reuses token_embd (no output.weight)
    spec_tensors: tuple[str, ...] = ()  # tensors read into the specs (RoPE factors), not loaded as weights
    fused_qkv: bool = False  # q, k, v stored as one attn_qkv tensor (phi3), split by rows at load
    fused_gate_up: bool = False  # gate and up stored as one ffn_up of 2 * ffn_dim rows (phi3)
    fused_gate_up_exps: bool = False  # each expert's gate and up as one ffn_gate_up_exps matrix (gemma4)
    # Per-layer inputs (gemma4 E2B/E4B): each layer adds a projection of a gated per-layer embedding
    # (per_layer_token_embd) of this width; 0 = none
    per_layer_dim: int = 0
    fused_ba: bool = False  # Gated DeltaNet beta and alpha stored as one ssm_ba, grouped by key head

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a per-sequence recurrent state (a hybrid model)."""
        return any(s.recurrent for s in self.layers)

    def head_dim_of(self, il: int) -> int:
        return self.layers[il].head_dim or self.head_dim

    def kv_heads_of(self, il: int) -> int:
        return self.layers[il].kv_heads or self.n_kv_heads

    def ffn_dim_of(self, il: int) -> int:
        return self.layers[il].ffn_dim or self.ffn_dim

    def kv_row_shape(self) -> tuple[int, int]:
        """(kv heads, head dim) of the KV pool's rows: the widest layer's. A narrower layer sees its
        slab of the pool as more, smaller blocks (see kv_block_factor)."""
        shapes = [(self.kv_heads_of(il), self.head_dim_of(il)) for il in range(len(self.layers))]
        return max(shapes, key=lambda s: s[0] * s[1], default=(self.n_kv_heads, self.head_dim))

    def kv_block_factor(self, il: int) -> int:
        """How many of layer il's own blocks one pool block holds (1 where its rows are the pool's)."""
        kvh, hd = self.kv_row_shape()
        return (kvh * hd) // (self.kv_heads_of(il) * self.head_dim_of(il))

    def context_warning(self, n_ctx: int) -> str | None:
        """One line when a context of n_ctx tokens exceeds the trained one and no layer's RoPE is scaled
        (positions past training are then extrapolated: quality degrades, it is no error)."""
        scaled = any(s.rope.freq_scale != 1.0 or s.rope.yarn_orig_ctx or s.rope.factors for s in self.layers)
        if n_ctx <= self.context_length or scaled:
            return None
        return (
            f"context {n_ctx:,} exceeds the {self.context_length:,} tokens {self.architecture} was trained "
            "on and the file sets no RoPE scaling: expect degraded output past that"
        )

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
