"""Building blocks shared by the architectures: attention over the paged KV cache and feed-forwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.models.base import ForwardBatch, ModelArgs, WeightLoader


@dataclass(slots=True)
class AttentionWeights:
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any = None  # qwen2 has biases on q, k, v
    bk: Any = None
    bv: Any = None
    q_norm: Any = None  # gemma3 / qwen3 normalise each head of q and k
    k_norm: Any = None

    @classmethod
    def load(cls, w: WeightLoader, prefix: str) -> AttentionWeights:
        return cls(
            wq=w.matrix(f"{prefix}.attn_q.weight"),
            wk=w.matrix(f"{prefix}.attn_k.weight"),
            wv=w.matrix(f"{prefix}.attn_v.weight"),
            wo=w.matrix(f"{prefix}.attn_output.weight"),
            bq=w.optional_vector(f"{prefix}.attn_q.bias"),
            bk=w.optional_vector(f"{prefix}.attn_k.bias"),
            bv=w.optional_vector(f"{prefix}.attn_v.bias"),
            q_norm=w.optional_vector(f"{prefix}.attn_q_norm.weight"),
            k_norm=w.optional_vector(f"{prefix}.attn_k_norm.weight"),
        )


@dataclass(slots=True)
class FeedForwardWeights:
    gate: Any
    up: Any
    down: Any

    @classmethod
    def load(cls, w: WeightLoader, prefix: str) -> FeedForwardWeights:
        return cls(
            gate=w.matrix(f"{prefix}.ffn_gate.weight"),
            up=w.matrix(f"{prefix}.ffn_up.weight"),
            down=w.matrix(f"{prefix}.ffn_down.weight"),
        )


def _add_bias(y: Any, bias: Any) -> Any:
    return y if bias is None else y + bias


def self_attention(
    b: Any, args: ModelArgs, aw: AttentionWeights, h: Any, batch: ForwardBatch, kv: Any, il: int
) -> Any:
    """Project to q/k/v, rotate, write k/v into the paged cache, attend, project out."""
    n_tokens = h.shape[0]
    q, k, v = b.linear_many(h, [aw.wq, aw.wk, aw.wv])
    q = _add_bias(q, aw.bq).reshape(n_tokens, args.n_heads, args.head_dim)
    k = _add_bias(k, aw.bk).reshape(n_tokens, args.n_kv_heads, args.head_dim)
    v = _add_bias(v, aw.bv).reshape(n_tokens, args.n_kv_heads, args.head_dim)
    if aw.q_norm is not None:
        q = b.rms_norm(q, aw.q_norm, args.norm_eps)
        k = b.rms_norm(k, aw.k_norm, args.norm_eps)
    k_cache, v_cache = kv.layer(il)
    q, k = b.rope_store_kv(
        q,
        k,
        v,
        batch.positions,
        args.rope_dim,
        args.layer_rope_base(il),
        args.rope_neox,
        k_cache,
        v_cache,
        batch.slot_mapping,
    )
    out = b.paged_attention(
        q,
        k_cache,
        v_cache,
        batch.query_start_loc,
        batch.context_lens,
        batch.block_tables,
        args.attn_scale,
        args.layer_window(il),
    )
    return b.linear(out.reshape(n_tokens, args.n_heads * args.head_dim), aw.wo)


def swiglu_ffn(b: Any, fw: FeedForwardWeights, h: Any) -> Any:
    gate, up = b.linear_many(h, [fw.gate, fw.up])
    return b.linear(b.swiglu(gate, up), fw.down)


def geglu_ffn(b: Any, fw: FeedForwardWeights, h: Any) -> Any:
    gate, up = b.linear_many(h, [fw.gate, fw.up])
    return b.linear_precise(b.geglu(gate, up), fw.down)  # GeGLU outputs have large outliers
