"""mistral3 (Ministral 3, Mistral Small 3.x / Magistral text): llama's layer (adjacent-pair RoPE,
optional mixture of experts) with what llama.cpp's mistral3 graph adds:

- attention temperature (`attention.temperature_scale`, Llama 4's scaling): each rotated query is
  multiplied by 1 + scale * ln(floor(pos / L) + 1), L being YaRN's original context
  (`rope.scaling.original_context_length`, else the trained one);
- YaRN's `rope.scaling.yarn_log_multiplier` (mscale_all_dim), which changes the cos/sin magnitude.

The optional attn_output / ffn biases llama.cpp accepts are not read: a file with them is refused by
tensor name (WeightLoader.check_all_read).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from localllm.errors import ModelFormatError
from localllm.models import llama
from localllm.models.spec import ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile


def read_args(gf: GGUFFile) -> ModelArgs:
    args = llama.read_args(gf)
    log_mul = float(gf.arch_get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    temp = float(gf.arch_get("attention.temperature_scale", 0.0) or 0.0)
    length = int(gf.arch_get("rope.scaling.original_context_length", args.context_length) or 0)
    if temp and length <= 0:
        raise ModelFormatError(
            f"{gf.path.name}: an attention temperature needs a positive "
            f"'{gf.architecture}.rope.scaling.original_context_length'"
        )
    layers = tuple(
        dataclasses.replace(
            s, rope=dataclasses.replace(s.rope, yarn_log_mul=log_mul if s.rope.yarn_orig_ctx else 0.0),
            attn_temp_scale=temp, attn_temp_length=length if temp else 0,
        )
        for s in args.layers
    )  # fmt: skip
    return dataclasses.replace(args, layers=layers)
