"""qwen3 (Qwen3): llama's layer with RMSNorm on each head of q and k, no biases, NEOX RoPE; its head
dim (attention.key_length) need not be dim / heads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localllm.errors import ModelFormatError
from localllm.models import llama
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile


def read_args(gf: GGUFFile) -> ModelArgs:
    args = llama.read_args(gf, neox=True)
    if not all(s.qk_norm for s in args.layers):
        raise ModelFormatError(f"{gf.path.name}: a qwen3 file needs attn_q_norm / attn_k_norm in every layer")
    return args
