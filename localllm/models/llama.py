"""llama (SmolLM2, Llama 2/3, Mistral, Mixtral): RMSNorm, adjacent-pair RoPE, grouped-query attention,
SwiGLU, or Mixtral's mixture of experts where the file sets `llama.expert_count`.

llama-family files may carry q/k/v biases or q/k norms, Mistral-style files a sliding window for
every layer, Llama 3.1+ files `rope_freqs.weight` (per-pair RoPE frequency divisors, read by
base.read_rope) and linear or YaRN scaling keys; each is read from the file, so a variant that only
changes these needs no code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localllm.models.base import has_layer_tensor, make_args, read_hyper, read_moe, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile


def read_args(gf: GGUFFile, neox: bool = False, moe: dict | None = None) -> ModelArgs:
    """neox: llama GGUFs store q/k permuted for adjacent-pair rotation; qwen2's are not permuted.
    moe: the MoE LayerSpec fields (qwen*moe); by default Mixtral's (experts feed_forward_length wide,
    top-k weights renormalised) where the file has experts."""
    h = read_hyper(gf)
    moe = read_moe(gf, h, None, renorm=True) if moe is None else moe
    rope = read_rope(gf, h, neox)
    window = int(gf.arch_get("attention.sliding_window", 0) or 0)
    layers = [
        LayerSpec(
            rope=rope,
            window=window,
            qkv_bias=has_layer_tensor(gf, il, "attn_q.bias"),
            qk_norm=has_layer_tensor(gf, il, "attn_q_norm"),
            **moe,
        )
        for il in range(h.n_layers)
    ]
    return make_args(gf, h, layers)
