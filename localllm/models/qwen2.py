"""qwen2 (Qwen2 / Qwen2.5): llama's layer with q/k/v biases and NEOX-style (half-split) RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localllm.models import llama
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile


def read_args(gf: GGUFFile) -> ModelArgs:
    return llama.read_args(gf, neox=True)
