"""gemma3: llama's skeleton with Gemma's differences, all spec fields.

Embeddings scaled by sqrt(dim); RMSNorm on each head of q and k; norms after attention and after the
feed-forward as well as before; a GELU(tanh)-gated feed-forward (its outputs have large outliers, so
the down projection keeps near-float activations); NEOX RoPE whose base is 10,000 on local layers (not
stored in the file) and the file's base on global ones; a sliding window on five of every six layers.
The norm weights in GGUF files already include Gemma's +1.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from localllm.models.base import make_args, read_hyper, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's hard-coded base for gemma3's sliding-window layers
SLIDING_PATTERN = 6  # every sixth layer is global


def read_args(gf: GGUFFile) -> ModelArgs:
    h = read_hyper(gf)
    window = int(gf.arch_get("attention.sliding_window", 0) or 0)
    global_rope, local_rope = read_rope(gf, h, neox=True), read_rope(gf, h, neox=True, base=LOCAL_ROPE_BASE)
    layers = []
    for il in range(h.n_layers):
        local = window > 0 and (il + 1) % SLIDING_PATTERN != 0
        layers.append(
            LayerSpec(
                rope=local_rope if local else global_rope,
                window=window if local else 0,
                qk_norm=True,
                post_attn_norm=True,
                post_ffn_norm=True,
                activation="gelu_tanh",
                precise_down=True,
            )
        )
    return make_args(gf, h, layers, embedding_scale=math.sqrt(h.dim))
