"""smollm3 (SmolLM3): llama's layer, except that every fourth layer (3, 7, 11, ...) applies no rotary
embedding at all (NoPE), as llama.cpp's fixed n_no_rope_layer_step = 4; the file stores no key for it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from localllm.models import llama
from localllm.models.spec import NO_ROPE, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

NO_ROPE_STEP = 4  # layer il has no RoPE where (il + 1) % NO_ROPE_STEP == 0


def read_args(gf: GGUFFile) -> ModelArgs:
    args = llama.read_args(gf)
    layers = tuple(
        dataclasses.replace(s, rope=NO_ROPE) if (il + 1) % NO_ROPE_STEP == 0 else s
        for il, s in enumerate(args.layers)
    )
    return dataclasses.replace(args, layers=layers)
