"""qwen35moe (Qwen3.5-MoE) and qwen3next (Qwen3-Next): qwen35.py's hybrid layers with routed experts
(top-k renormalised) and a sigmoid-gated shared expert stored as ffn_*_shexp. qwen3next stores beta
and alpha as one ssm_ba, repeats key heads interleaved, and rotates with plain NEOX RoPE."""

from __future__ import annotations

from localllm.models.qwen35 import TENSOR_NAMES as _DENSE
from localllm.models.qwen35 import read_args  # noqa: F401 (the architecture's reader)

TENSOR_NAMES = {
    **_DENSE,
    "gate": "ffn_gate_shexp.weight",
    "up": "ffn_up_shexp.weight",
    "down": "ffn_down_shexp.weight",
}
