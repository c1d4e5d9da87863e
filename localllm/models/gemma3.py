"""The gemma3 architecture: llama's skeleton with Gemma's differences.

Embeddings scaled by sqrt(dim); RMSNorm on each head of q and k; norms after attention and after the
feed-forward as well as before; a GELU(tanh)-gated feed-forward; NEOX RoPE whose base is 10,000 on local
layers (not stored in the file) and the file's base on global ones; and a 512-token sliding window on
five of every six layers, applied inside paged attention. The norm weights already include Gemma's +1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from localllm.gguf_file import GGUFFile
from localllm.models.base import ForwardBatch, ModelArgs, WeightLoader, read_args
from localllm.models.layers import AttentionWeights, FeedForwardWeights, geglu_ffn, self_attention
from localllm.models.llama import LlamaModel

LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's hard-coded base for gemma3's sliding-window layers
SLIDING_PATTERN = 6  # every sixth layer is global


@dataclass(slots=True)
class Gemma3Layer:
    attn_norm: Any
    attn: AttentionWeights
    post_attention_norm: Any
    ffn_norm: Any
    ffn: FeedForwardWeights
    post_ffw_norm: Any


class Gemma3Model(LlamaModel):
    rope_neox = True
    fusable_layers = False  # post-norms, q/k norms, GeGLU, sliding windows: op by op

    def read_args(self, gf: GGUFFile) -> ModelArgs:
        dim = int(gf.arch_get("embedding_length"))
        return read_args(
            gf,
            rope_neox=True,
            rope_base_local=LOCAL_ROPE_BASE,
            sliding_window=int(gf.arch_get("attention.sliding_window", 0)),
            sliding_pattern=SLIDING_PATTERN,
            embedding_scale=math.sqrt(dim),
        )

    def load_layer(self, w: WeightLoader, prefix: str) -> Gemma3Layer:
        return Gemma3Layer(
            attn_norm=w.vector(f"{prefix}.attn_norm.weight"),
            attn=AttentionWeights.load(w, prefix),
            post_attention_norm=w.vector(f"{prefix}.post_attention_norm.weight"),
            ffn_norm=w.vector(f"{prefix}.ffn_norm.weight"),
            ffn=FeedForwardWeights.load(w, prefix),
            post_ffw_norm=w.vector(f"{prefix}.post_ffw_norm.weight"),
        )

    def forward_layer(self, il: int, x: Any, batch: ForwardBatch, kv: Any) -> Any:
        b, layer, eps = self.backend, self.layers[il], self.args.norm_eps
        h = self_attention(b, self.args, layer.attn, b.rms_norm(x, layer.attn_norm, eps), batch, kv, il)
        x = x + b.rms_norm(h, layer.post_attention_norm, eps)
        h = geglu_ffn(b, layer.ffn, b.rms_norm(x, layer.ffn_norm, eps))
        return x + b.rms_norm(h, layer.post_ffw_norm, eps)
