"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention with a mixture-of-experts FFN; each
token's top-k router probabilities are renormalised to sum 1 (llama.cpp does so for every qwen3moe
file, whatever `expert_weights_norm` says)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localllm.errors import ModelFormatError
from localllm.models import llama
from localllm.models.base import read_hyper, read_moe
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile


def read_args(gf: GGUFFile) -> ModelArgs:
    moe = read_moe(gf, read_hyper(gf), "expert_feed_forward_length", renorm=True)
    if not moe:
        raise ModelFormatError(f"{gf.path.name}: a qwen3moe file needs '{gf.architecture}.expert_count'")
    args = llama.read_args(gf, neox=True, moe=moe)
    if not all(s.qk_norm for s in args.layers):
        raise ModelFormatError(f"{gf.path.name}: a qwen3moe file needs attn_q_norm and attn_k_norm")
    return args
