"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): llama's layer with q/k/v fused in one attn_qkv tensor and gate and
up in one ffn_up of 2 x ffn rows (split by rows at load: the fused stack then runs it like llama), NEOX
RoPE, and LongRoPE: per-pair factors `rope_factors_short` (or `_long`) and rope.scaling.attn_factor.

llama.cpp picks the long factors when the context exceeds rope.scaling.original_context_length; the
model here is read before the context is known, so it takes the short ones (llama.cpp's choice for
contexts up to the original length, e.g. 4096 for the 128k models) and says so when they differ.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from localllm.models.base import has_layer_tensor, make_args, read_hyper, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.gguf_file import GGUFFile

log = logging.getLogger("localllm")


def read_args(gf: GGUFFile) -> ModelArgs:
    h = read_hyper(gf)
    rope = read_rope(gf, h, neox=True, factors_tensor="rope_factors_short.weight")
    if "rope_factors_long.weight" in gf.tensors:
        orig = gf.arch_get("rope.scaling.original_context_length", h.context_length)
        log.info("phi3: LongRoPE short factors (contexts up to %s tokens, as llama.cpp there)", orig)
    fused_qkv = has_layer_tensor(gf, 0, "attn_qkv")
    layers = [LayerSpec(rope=rope) for _ in range(h.n_layers)]
    fused_gate_up = "blk.0.ffn_gate.weight" not in gf.tensors
    return make_args(gf, h, layers, fused_qkv=fused_qkv, fused_gate_up=fused_gate_up)
