"""gpt-oss (OpenAI's gpt-oss-20b / -120b; llama.cpp's LLM_ARCH_OPENAI_MOE): a mixture-of-experts decoder.

As llama.cpp builds it: RMSNorm before attention and before the experts (the latter stored as
`post_attention_norm`); q/k/v and output biases; attention sinks (a learned logit per head in every
softmax's denominator); NEOX RoPE with YaRN scaling; sliding-window attention on even layers and full
attention on odd ones (`attention.sliding_window_pattern`, default 2); top-k experts whose weights are
the softmax over the chosen (biased) router logits, which equals the chosen share of the softmax over
all of them (expert_renorm); expert gate/up/down biases; the clamped SwiGLU (spec.OAI_*).  Files
store the experts in MXFP4.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from localllm.errors import ModelFormatError
from localllm.models.base import has_layer_tensor, make_args, read_hyper, read_moe, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

TENSOR_NAMES = {"ffn_norm": "post_attention_norm.weight"}
SWA_PATTERN = 2  # llama.cpp's default for gpt-oss: layer il slides when il % 2 == 0


def sliding_layers(gf: GGUFFile, n_layers: int) -> list[bool]:
    """Which layers use the sliding window: the file's per-layer flags, or every layer but the last of
    each group of `attention.sliding_window_pattern` (llama.cpp's set_swa_pattern, dense last)."""
    pattern = gf.arch_get("attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < n_layers:
            raise ModelFormatError(
                f"{gf.path.name}: sliding_window_pattern has {len(pattern)} flags for {n_layers} layers"
            )
        return [bool(p) for p in pattern[:n_layers]]
    n = int(pattern)
    return [n == 0 or il % n < n - 1 for il in range(n_layers)]


def read_args(gf: GGUFFile) -> ModelArgs:
    h = read_hyper(gf)
    moe = read_moe(gf, h, "expert_feed_forward_length", renorm=True)
    if not moe:
        raise ModelFormatError(f"{gf.path.name}: a gpt-oss file needs '{gf.architecture}.expert_count'")
    window = int(gf.arch_get("attention.sliding_window", 0) or 0)
    rope = read_rope(gf, h, neox=True)
    swa_base = gf.arch_get("rope.freq_base_swa")
    swa_rope = rope if swa_base is None else dataclasses.replace(rope, base=float(swa_base))
    layers = [
        LayerSpec(
            rope=swa_rope if sliding and window else rope,
            window=window if sliding else 0,
            qkv_bias=has_layer_tensor(gf, il, "attn_q.bias"),
            activation="swiglu_oai",
            attn_sinks=True,
            o_bias=True,
            router_bias=True,
            expert_bias=True,
            **moe,
        )
        for il, sliding in enumerate(sliding_layers(gf, h.n_layers))
    ]
    return make_args(gf, h, layers)
