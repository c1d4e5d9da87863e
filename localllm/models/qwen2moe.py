"""qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2's attention (q/k/v biases, NEOX RoPE) with a
mixture-of-experts FFN whose top-k router probabilities are used as they are (not renormalised), plus
a shared expert: a dense SwiGLU FFN (ffn_*_shexp) scaled by sigmoid(ffn_gate_inp_shexp . x)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from localllm.errors import ModelFormatError
from localllm.models import llama
from localllm.models.base import read_hyper, read_moe
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

# The shared expert is the layer's dense FFN, stored under its own names.
TENSOR_NAMES = {"gate": "ffn_gate_shexp.weight", "up": "ffn_up_shexp.weight", "down": "ffn_down_shexp.weight"}


def read_args(gf: GGUFFile) -> ModelArgs:
    h = read_hyper(gf)
    moe = read_moe(gf, h, "expert_feed_forward_length", renorm=False)
    if not moe:
        raise ModelFormatError(f"{gf.path.name}: a qwen2moe file needs '{gf.architecture}.expert_count'")
    args = llama.read_args(gf, neox=True, moe={**moe, "shared_expert": True})
    shared = int(gf.arch_get("expert_shared_feed_forward_length", h.ffn_dim) or h.ffn_dim)
    return dataclasses.replace(args, ffn_dim=shared)  # the dense FFN is the shared expert
