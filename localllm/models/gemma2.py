"""gemma2: Gemma 3's layer without q/k norms, with llama.cpp's gemma2 semantics.

Attention scores soft-capped (attn_logit_softcapping, default 50) and final logits too
(final_logit_softcapping, default 30); a sliding window (default 4096) on the layers the pattern marks
(attention.sliding_window_pattern, default 2: even layers windowed, odd ones global); queries scaled by
1/sqrt(head dim), or 1/sqrt(dim / heads) for the 46-layer 27B as llama.cpp does (it does not read
query_pre_attn_scalar); NEOX RoPE, rope.freq_base_swa on windowed layers when present; embeddings
scaled by sqrt(dim), output tied to them; post-norms and GeGLU as in Gemma 3.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from localllm.models.base import make_args, read_hyper, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

DEFAULT_WINDOW, DEFAULT_PATTERN = 4096, 2
DEFAULT_ATTN_CAP, DEFAULT_FINAL_CAP = 50.0, 30.0
LAYERS_27B = 46


def windowed_layers(gf: GGUFFile, n_layers: int, default_pattern: int) -> list[bool]:
    """Which layers use the sliding window: a per-layer array, or every layer but the last of each
    `pattern` (llama.cpp's set_swa_pattern; 0 means all)."""
    pattern = gf.arch_get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "__len__"):
        return [bool(v) for v in pattern[:n_layers]] + [False] * max(0, n_layers - len(pattern))
    n = int(pattern)
    return [n == 0 or il % n < n - 1 for il in range(n_layers)]


def read_args(gf: GGUFFile) -> ModelArgs:
    h = read_hyper(gf)
    window = int(gf.arch_get("attention.sliding_window", DEFAULT_WINDOW) or 0)
    rope = read_rope(gf, h, neox=True)
    local_rope = read_rope(gf, h, neox=True, base=gf.arch_get("rope.freq_base_swa", rope.base))
    cap = float(gf.arch_get("attn_logit_softcapping", DEFAULT_ATTN_CAP))
    layers = [
        LayerSpec(
            rope=local_rope if local else rope, window=window if local else 0, post_attn_norm=True,
            post_ffn_norm=True, activation="gelu_tanh", precise_down=True, attn_softcap=cap,
        )
        for local in windowed_layers(gf, h.n_layers, DEFAULT_PATTERN)
    ]  # fmt: skip
    head = h.dim / h.n_heads if h.n_layers == LAYERS_27B else h.head_dim
    return make_args(
        gf, h, layers, embedding_scale=math.sqrt(h.dim), attn_scale=1.0 / math.sqrt(head), tied_output=True,
        final_logit_softcap=float(gf.arch_get("final_logit_softcapping", DEFAULT_FINAL_CAP)),
    )  # fmt: skip
