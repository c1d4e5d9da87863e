"""The qwen2 architecture (Qwen2 / Qwen2.5): llama's layer with q/k/v biases and NEOX-style RoPE.

The biases are optional tensors the shared attention already applies, and an untied `output.weight`
is picked up by the llama loader, so only the rotation style differs.
"""

from __future__ import annotations

from localllm.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    rope_neox = True
