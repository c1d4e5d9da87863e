"""gemma4 (Gemma 4, dense): Gemma 3's layer as llama.cpp's gemma4 graph computes it.

Sliding-window layers are those `attention.sliding_window_pattern` (one bool per layer) marks; they
rotate `rope.dimension_count_swa` dims with base `rope.freq_base_swa` (10,000 when absent), the full
layers `rope.dimension_count` dims with the file's base and `rope_freqs.weight` (its 1e30 divisors
leave the unrotated part of a "proportional" RoPE still). Queries and keys get RMSNorm, values a
weightless one; a layer without attn_v uses its k projection as v; scores are not scaled (scale 1);
each layer's output is multiplied by its `layer_output_scale`; final logits soft-capped (default 30).

As the released files have them: sliding layers' heads `attention.key_length_swa` wide, full layers'
`attention.key_length`; `attention.head_count_kv` and `feed_forward_length` one value per layer or one
for all; the last `attention.shared_kv_layers` layers store no K/V but attend the cache of the last
storing layer of their kind; `embedding_length_per_layer_input` > 0 adds the per-layer inputs (E2B/E4B).

A layer with `ffn_gate_inp` (26B-A4B) runs its dense FFN and `expert_count` GeGLU experts side by side
(LayerSpec.parallel_experts): top `expert_used_count` of a softmax, renormalised, each
`expert_feed_forward_length` wide (one value per layer or one for all), gate and up separate or one
`ffn_gate_up_exps`, each expert's output times its `ffn_down_exps.scale` entry where the file has one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from localllm.errors import ModelFormatError
from localllm.models.base import make_args, per_layer_values, read_hyper, read_moe, read_rope
from localllm.models.gemma2 import windowed_layers
from localllm.models.spec import Hyper, LayerSpec, ModelArgs, RopeSpec

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

DEFAULT_FINAL_CAP = 30.0
LOCAL_ROPE_BASE = 10_000.0
OUT_SCALE = "layer_output_scale.weight"
FUSED_EXPERTS = "ffn_gate_up_exps.weight"
PER_LAYER_KEYS = ("attention.head_count_kv", "feed_forward_length")
# tensors llama.cpp loads on a KV-sharing layer but never reads (the layer projects no k or v)
UNUSED_ON_SHARED = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")


def read_args(gf: GGUFFile) -> ModelArgs:
    _refuse_unsupported(gf)
    h = read_hyper(gf, PER_LAYER_KEYS)
    window = int(gf.arch_get("attention.sliding_window", 0) or 0)
    full = read_rope(gf, h, neox=True)
    local = RopeSpec(
        dim=int(gf.arch_get("rope.dimension_count_swa", full.dim)), neox=True,
        base=float(gf.arch_get("rope.freq_base_swa", LOCAL_ROPE_BASE)), attn_factor=full.attn_factor,
    )  # fmt: skip
    swa = windowed_layers(gf, h.n_layers, 0)
    sizes = _layer_sizes(gf, h, swa)
    sources = _kv_sources(gf, h.n_layers, swa, sizes)
    moe = _moe_fields(gf, h)
    layers = [_layer(gf, il, local if s else full, window if s else 0, {**sizes[il], **moe[il]}, sources[il])
              for il, s in enumerate(swa)]  # fmt: skip
    scales = tuple(n for n in (f"blk.{il}.{OUT_SCALE}" for il in range(h.n_layers)) if n in gf.tensors)
    unused = tuple(f"blk.{il}.{n}" for il in range(h.n_layers) if sources[il] >= 0 for n in UNUSED_ON_SHARED)
    return make_args(
        gf, h, layers, embedding_scale=math.sqrt(h.dim), attn_scale=1.0,
        final_logit_softcap=float(gf.arch_get("final_logit_softcapping", DEFAULT_FINAL_CAP)),
        spec_tensors=(*(n for n in ("rope_freqs.weight",) if n in gf.tensors), *scales,
                      *(n for n in unused if n in gf.tensors)),
        per_layer_dim=int(gf.arch_get("embedding_length_per_layer_input", 0) or 0),
        fused_gate_up_exps=any(f"blk.{il}.{FUSED_EXPERTS}" in gf.tensors for il in range(h.n_layers)),
    )  # fmt: skip


def _layer(gf: GGUFFile, il: int, rope: RopeSpec, window: int, size: dict, source: int) -> LayerSpec:
    scale = _scalar(gf, f"blk.{il}.{OUT_SCALE}")
    if window:  # rope_freqs only turns the full layers
        rope = dataclasses.replace(rope, factors=())
    return LayerSpec(
        rope=rope, window=window, qk_norm=True, post_attn_norm=True, post_ffn_norm=True,
        activation="gelu_tanh", precise_down=True, v_norm=True,
        v_from_k=f"blk.{il}.attn_v.weight" not in gf.tensors, out_scale=scale, kv_source=source, **size,
    )  # fmt: skip


def _moe_fields(gf: GGUFFile, h: Hyper) -> list[dict]:
    """Each layer's mixture-of-experts LayerSpec fields ({} on a layer without ffn_gate_inp)."""
    moe = read_moe(gf, h, None, renorm=True)
    routed = [f"blk.{il}.ffn_gate_inp.weight" in gf.tensors for il in range(h.n_layers)]
    if not any(routed):
        return [{} for _ in routed]
    if not moe or gf.arch_get("expert_feed_forward_length") is None:
        raise ModelFormatError(
            f"{gf.path.name}: layers have ffn_gate_inp but '{gf.architecture}.expert_count', "
            "'expert_used_count' or 'expert_feed_forward_length' is missing"
        )
    widths = per_layer_values(gf, "expert_feed_forward_length", h.n_layers, None)
    fused = [f"blk.{il}.{FUSED_EXPERTS}" in gf.tensors for il in range(h.n_layers) if routed[il]]
    if len(set(fused)) > 1 or (
        fused[0] and len({int(w) for w, r in zip(widths, routed, strict=True) if r}) > 1
    ):
        raise ModelFormatError(
            f"{gf.path.name}: fused '{FUSED_EXPERTS}' on some expert layers only, or with per-layer widths"
        )
    return [
        {**moe, "expert_ffn_dim": int(widths[il]), "parallel_experts": True,
         "expert_scale": f"blk.{il}.ffn_down_exps.scale" in gf.tensors} if r else {}
        for il, r in enumerate(routed)
    ]  # fmt: skip


def _layer_sizes(gf: GGUFFile, h: Hyper, swa: list[bool]) -> list[dict]:
    """Each layer's head_dim / kv_heads / ffn_dim LayerSpec fields where they differ from Hyper's."""
    swa_dim = int(gf.arch_get("attention.key_length_swa", h.head_dim))
    v_full = gf.arch_get("attention.value_length", h.head_dim)
    v_swa = gf.arch_get("attention.value_length_swa", v_full)
    if (v_full, v_swa) != (h.head_dim, swa_dim):
        raise ModelFormatError(
            f"{gf.path.name}: '{gf.architecture}.attention.value_length' and '_swa' ({v_full}, {v_swa}) "
            f"differ from the key lengths ({h.head_dim}, {swa_dim}); gemma4 needs them equal"
        )
    kv = per_layer_values(gf, "attention.head_count_kv", h.n_layers, h.n_heads)
    ffn = per_layer_values(gf, "feed_forward_length", h.n_layers, h.ffn_dim)
    out = []
    for il, s in enumerate(swa):
        hd = swa_dim if s else h.head_dim
        own = {"head_dim": (hd, h.head_dim), "kv_heads": (int(kv[il]), h.n_kv_heads),
               "ffn_dim": (int(ffn[il]), h.ffn_dim)}  # fmt: skip
        out.append({k: v if v != model else 0 for k, (v, model) in own.items()})
    return out


def _kv_sources(gf: GGUFFile, n_layers: int, swa: list[bool], sizes: list[dict]) -> list[int]:
    """Per layer, the earlier layer whose KV cache it attends (-1: its own). As llama.cpp: the last
    `shared_kv_layers` layers reuse the last storing layer of their kind (the sliding one just
    before the last storing layer, or that last, full one)."""
    shared = int(gf.arch_get("attention.shared_kv_layers", 0) or 0)
    start = n_layers - shared
    if not shared:
        return [-1] * n_layers
    if not 2 <= start <= n_layers:
        raise ModelFormatError(
            f"{gf.path.name}: '{gf.architecture}.attention.shared_kv_layers' is {shared} of {n_layers} "
            "layers; at least two must store their own KV"
        )
    out = [-1] * start + [start - (2 if swa[il] else 1) for il in range(start, n_layers)]
    for il in range(start, n_layers):
        src = out[il]
        if swa[src] != swa[il] or sizes[src]["head_dim"] != sizes[il]["head_dim"] or \
                sizes[src]["kv_heads"] != sizes[il]["kv_heads"]:  # fmt: skip
            raise ModelFormatError(
                f"{gf.path.name}: layer {il} would attend layer {src}'s KV cache, which has another kind "
                "or shape (attention.shared_kv_layers, sliding_window_pattern)"
            )
    return out


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
    if "blk.0.attn_qkv.weight" in gf.tensors:
        raise ModelFormatError(f"{gf.path.name}: fused 'attn_qkv' tensors are not supported for {arch}")
