"""gemma4 (Gemma 4, dense): Gemma 3's layer as llama.cpp's gemma4 graph computes it.

Sliding-window layers are those `attention.sliding_window_pattern` (one bool per layer) marks; they
rotate `rope.dimension_count_swa` dims with base `rope.freq_base_swa` (10,000 when absent), the full
layers `rope.dimension_count` dims with the file's base and `rope_freqs.weight` (its 1e30 divisors
leave the unrotated part of a "proportional" RoPE still). Queries and keys get RMSNorm, values a
weightless one; a layer without attn_v uses its k projection as v; scores are not scaled (scale 1);
each layer's output is multiplied by its `layer_output_scale`; final logits soft-capped (default 30).

Refused by name rather than mis-computed: per-layer embeddings (E2B/E4B), KV sharing across layers,
mixture-of-experts layers (26B-A4B), and head sizes or KV head counts that differ between sliding and
full layers (which real Gemma 4 checkpoints have: a per-layer KV-cache layout is not implemented yet).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import ModelFormatError
from localllm.models.base import make_args, read_hyper, read_rope
from localllm.models.gemma2 import windowed_layers
from localllm.models.spec import LayerSpec, ModelArgs, RopeSpec

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

DEFAULT_FINAL_CAP = 30.0
LOCAL_ROPE_BASE = 10_000.0
OUT_SCALE = "layer_output_scale.weight"
# metadata key (under "gemma4.") -> what localllm does not run yet, refused when set to anything but 0
UNSUPPORTED = {
    "embedding_length_per_layer_input": "per-layer embeddings (Gemma 4 E2B/E4B)",
    "attention.shared_kv_layers": "KV sharing across layers (Gemma 4 E2B/E4B)",
    "expert_count": "mixture-of-experts layers (Gemma 4 26B-A4B)",
}


def read_args(gf: GGUFFile) -> ModelArgs:
    _refuse_unsupported(gf)
    h = read_hyper(gf)
    window = int(gf.arch_get("attention.sliding_window", 0) or 0)
    full = read_rope(gf, h, neox=True)
    local = RopeSpec(
        dim=int(gf.arch_get("rope.dimension_count_swa", h.head_dim)), neox=True,
        base=float(gf.arch_get("rope.freq_base_swa", LOCAL_ROPE_BASE)), attn_factor=full.attn_factor,
    )  # fmt: skip
    layers = [_layer(gf, il, local if swa else full, window if swa else 0)
              for il, swa in enumerate(windowed_layers(gf, h.n_layers, 0))]  # fmt: skip
    scales = tuple(n for n in (f"blk.{il}.{OUT_SCALE}" for il in range(h.n_layers)) if n in gf.tensors)
    return make_args(
        gf, h, layers, embedding_scale=math.sqrt(h.dim), attn_scale=1.0,
        final_logit_softcap=float(gf.arch_get("final_logit_softcapping", DEFAULT_FINAL_CAP)),
        spec_tensors=(*(n for n in ("rope_freqs.weight",) if n in gf.tensors), *scales),
    )  # fmt: skip


def _layer(gf: GGUFFile, il: int, rope: RopeSpec, window: int) -> LayerSpec:
    scale = _scalar(gf, f"blk.{il}.{OUT_SCALE}")
    if window:  # rope_freqs only turns the full layers
        rope = dataclasses.replace(rope, factors=())
    return LayerSpec(
        rope=rope, window=window, qk_norm=True, post_attn_norm=True, post_ffn_norm=True,
        activation="gelu_tanh", precise_down=True, v_norm=True,
        v_from_k=f"blk.{il}.attn_v.weight" not in gf.tensors, out_scale=scale,
    )  # fmt: skip


def _scalar(gf: GGUFFile, name: str) -> float:
    """A one-element tensor's value (1.0 when absent)."""
    from localllm.quant import dequantize

    if name not in gf.tensors:
        return 1.0
    values = dequantize(gf.raw(name), gf.tensors[name].ggml_type).reshape(-1)
    if values.size != 1 or not np.isfinite(values[0]):
        raise ModelFormatError(f"{gf.path.name}: tensor '{name}' should hold one finite number")
    return float(values[0])


def _refuse_unsupported(gf: GGUFFile) -> None:
    arch = gf.architecture
    for key, what in UNSUPPORTED.items():
        if gf.arch_get(key, 0):
            raise ModelFormatError(f"{gf.path.name}: '{arch}.{key}' is set: {what}, not supported yet")
    for a, b in (("key_length", "key_length_swa"), ("value_length", "value_length_swa")):
        full, swa = gf.arch_get(f"attention.{a}"), gf.arch_get(f"attention.{b}")
        if swa is not None and swa != full:
            raise ModelFormatError(
                f"{gf.path.name}: '{arch}.attention.{b}' ({swa}) differs from '{arch}.attention.{a}' "
                f"({full}): sliding and full layers of different head sizes are not supported yet"
            )
    if "blk.0.attn_qkv.weight" in gf.tensors:
        raise ModelFormatError(f"{gf.path.name}: fused 'attn_qkv' tensors are not supported for {arch}")
