"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): llama's layer with q/k/v fused in one attn_qkv tensor and gate and
up in one ffn_up of 2 x ffn rows (split by rows at load: the fused stack then runs it like llama), NEOX
RoPE, and LongRoPE: per-pair factors `rope_factors_short` or `rope_factors_long`, and
rope.scaling.attn_factor on cos/sin either way.

As llama.cpp (llama_model::get_rope_factors), the long factors apply when the context a sequence may
reach exceeds rope.scaling.original_context_length (the trained context when absent), e.g. `--ctx-size
8192` on a 128k model trained from 4096; the short ones otherwise. The choice is per engine, not per
position: every token of a long-context engine rotates with the long factors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from localllm.models.base import has_layer_tensor, make_args, read_hyper, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

log = logging.getLogger("localllm")

READS_CONTEXT = True  # load_model passes the context: it picks the factors


def read_args(gf: GGUFFile, n_ctx: int | None = None) -> ModelArgs:
    h = read_hyper(gf)
    factors = rope_factors_tensor(gf, n_ctx if n_ctx is not None else h.context_length)
    rope = read_rope(gf, h, neox=True, factors_tensor=factors)
    fused_qkv = has_layer_tensor(gf, 0, "attn_qkv")
    layers = [LayerSpec(rope=rope) for _ in range(h.n_layers)]
    fused_gate_up = "blk.0.ffn_gate.weight" not in gf.tensors
    return make_args(gf, h, layers, fused_qkv=fused_qkv, fused_gate_up=fused_gate_up)


def rope_factors_tensor(gf: GGUFFile, n_ctx: int) -> str:
    """Which LongRoPE factor tensor a context of n_ctx tokens uses (llama.cpp's rule)."""
    if "rope_factors_long.weight" not in gf.tensors:
        return "rope_factors_short.weight"
    original = gf.arch_get("rope.scaling.original_context_length") or read_hyper(gf).context_length
    kind = "long" if n_ctx > int(original) else "short"
    log.info("phi3: LongRoPE %s factors (context %s, original %s)", kind, n_ctx, original)
    return f"rope_factors_{kind}.weight"
