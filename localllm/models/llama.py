"""The llama architecture (SmolLM2, Llama 2/3, Mistral): RMSNorm, RoPE, grouped-query attention, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.gguf_file import GGUFFile
from localllm.models.base import ForwardBatch, ModelArgs, WeightLoader, read_args
from localllm.models.layers import AttentionWeights, FeedForwardWeights, self_attention, swiglu_ffn


@dataclass(slots=True)
class Layer:
    attn_norm: Any
    attn: AttentionWeights
    ffn_norm: Any
    ffn: FeedForwardWeights


class LlamaModel:
    """A pre-norm decoder. Subclasses change the arguments, the layer loading or the layer itself."""

    rope_neox = False  # llama GGUFs store q/k permuted for adjacent-pair rotation
    fusable_layers = True  # forward_layer is the plain one a backend may run fused (decoder_stack)

    def __init__(self, gf: GGUFFile, backend: Any):
        self.backend = backend
        self.args = self.read_args(gf)
        w = WeightLoader(gf, backend)
        self.tok_embd = w.matrix("token_embd.weight")
        # tied embeddings: the output projection reuses the token embedding
        self.output = w.matrix("output.weight") if w.has("output.weight") else self.tok_embd
        self.output_norm = w.vector("output_norm.weight")
        self.layers = [self.load_layer(w, f"blk.{il}") for il in range(self.args.n_layers)]

    def read_args(self, gf: GGUFFile) -> ModelArgs:
        return read_args(gf, rope_neox=self.rope_neox)

    def load_layer(self, w: WeightLoader, prefix: str) -> Layer:
        return Layer(
            attn_norm=w.vector(f"{prefix}.attn_norm.weight"),
            attn=AttentionWeights.load(w, prefix),
            ffn_norm=w.vector(f"{prefix}.ffn_norm.weight"),
            ffn=FeedForwardWeights.load(w, prefix),
        )

    def forward_layer(self, il: int, x: Any, batch: ForwardBatch, kv: Any) -> Any:
        b, layer, eps = self.backend, self.layers[il], self.args.norm_eps
        x = x + self_attention(b, self.args, layer.attn, b.rms_norm(x, layer.attn_norm, eps), batch, kv, il)
        return x + swiglu_ffn(b, layer.ffn, b.rms_norm(x, layer.ffn_norm, eps))

    def embed(self, input_ids: Any) -> Any:
        x = self.backend.embedding(self.tok_embd, input_ids)
        return x if self.args.embedding_scale == 1.0 else x * self.args.embedding_scale

    def forward(self, batch: ForwardBatch, kv: Any) -> Any:
        """Logits (len(batch.logits_indices), vocab) for the rows that need them."""
        x = self.embed(batch.input_ids)
        stack = getattr(self.backend, "decoder_stack", None)
        fused = stack(self, x, batch, kv) if stack is not None and self.fusable_layers else None
        if fused is not None:
            x = fused
        else:
            for il in range(self.args.n_layers):
                x = self.forward_layer(il, x, batch, kv)
        x = self.backend.rms_norm(x[batch.logits_indices], self.output_norm, self.args.norm_eps)
        return self.backend.linear_precise(x, self.output)
