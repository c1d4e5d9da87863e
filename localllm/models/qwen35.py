"""qwen35 (Qwen3.5 dense) and, with qwen35moe.py's names, qwen35moe and qwen3next: hybrid models whose
layers are Gated DeltaNet (models/gated_delta.py, a recurrent state per sequence) except every
`full_attention_interval`-th, which is gated full attention: q's projection carries a per-head sigmoid
gate on the attention output, q/k RMS norms, a partial NEOX rotation.

Layer i is recurrent where `attention.recurrent_layers` says, else where (i + 1) % interval != 0
(llama.cpp's default interval: 4). qwen35's interleaved M-RoPE sections reduce to one rotation for text
(every section's position is the token's); a file whose sections leave a pair to the fourth (image)
position is refused. Multi-token-prediction layers (`nextn_predict_layers`) are not run, their tensors
not loaded. The FFN's input norm is stored as post_attention_norm.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from localllm.errors import ModelFormatError
from localllm.models.base import make_args, read_hyper, read_moe, read_rope
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.loading.file import GGUFFile

TENSOR_NAMES = {"ffn_norm": "post_attention_norm.weight"}


def read_args(gf: GGUFFile) -> ModelArgs:
    arch, h = gf.architecture, read_hyper(gf)
    mtp = int(gf.arch_get("nextn_predict_layers", 0) or 0)
    h = dataclasses.replace(h, n_layers=h.n_layers - mtp)
    moe: dict[str, Any] = {}
    if arch != "qwen35":
        moe = read_moe(gf, h, "expert_feed_forward_length", renorm=True)
        if not moe:
            raise ModelFormatError(f"{gf.path.name}: a {arch} file needs '{arch}.expert_count'")
        moe["shared_expert"] = "blk.0.ffn_gate_shexp.weight" in gf.tensors
        h = dataclasses.replace(h, ffn_dim=int(gf.arch_get("expert_shared_feed_forward_length", h.ffn_dim)))
    rope = read_rope(gf, h, neox=True)
    if arch != "qwen3next":
        check_text_sections(gf, rope.dim)
    ssm = read_ssm(gf, interleaved=arch == "qwen3next")
    recurrent = recurrent_layers(gf, h.n_layers)
    layers = [
        LayerSpec(rope=rope, **moe, **(ssm if recurrent[il] else {"qk_norm": True, "attn_gate": True}))
        for il in range(h.n_layers)
    ]
    skipped = tuple(n for n in gf.tensors if _layer_of(n) >= h.n_layers)
    args = make_args(gf, h, layers, fused_ba=arch == "qwen3next")
    return dataclasses.replace(args, spec_tensors=args.spec_tensors + skipped)


def read_ssm(gf: GGUFFile, interleaved: bool) -> dict[str, Any]:
    """The Gated DeltaNet LayerSpec fields from the ssm.* keys (llama.cpp's names)."""
    keys = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
    conv, dk, n_k, n_v, inner = (int(gf.arch_get(f"ssm.{k}", 0) or 0) for k in keys)
    if min(conv, dk, n_k, n_v) <= 0 or n_v % n_k or inner != dk * n_v:
        raise ModelFormatError(
            f"{gf.path.name}: the ssm.* keys of {gf.architecture} do not describe a Gated DeltaNet "
            f"(conv {conv}, state {dk}, {n_k} key / {n_v} value heads, inner size {inner})"
        )
    return {"mixer": "gated_delta_net", "ssm_conv": conv, "ssm_k_heads": n_k, "ssm_v_heads": n_v,
            "ssm_head_dim": dk, "ssm_interleaved": interleaved}  # fmt: skip


def recurrent_layers(gf: GGUFFile, n_layers: int) -> list[bool]:
    flags = gf.arch_get("attention.recurrent_layers")
    if flags is not None:
        flags = [bool(f) for f in list(flags)[:n_layers]]
        if len(flags) == n_layers:
            return flags
    interval = int(gf.arch_get("full_attention_interval", 4) or 4)
    return [(il + 1) % interval != 0 for il in range(n_layers)]


def check_text_sections(gf: GGUFFile, rope_dim: int) -> None:
    """Refuse interleaved M-RoPE sections that give a rotated pair the fourth position, which text
    leaves at 0 (llama.cpp's mapping: pair i is in sector i % sum; sector % 3 picks t, h or w while
    within 3 * that section)."""
    sections = [int(x) for x in list(gf.arch_get("rope.dimension_sections", []) or [])][:4]
    total = sum(sections)
    if total <= 0:
        return
    sections += [0] * (4 - len(sections))
    for i in range(rope_dim // 2):
        sector = i % total
        if not any(sector % 3 == j and sector < 3 * sections[j] for j in range(3)):
            raise ModelFormatError(
                f"{gf.path.name}: rope.dimension_sections {sections} rotate pair {i} by an image position; "
                "localllm runs text only"
            )


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1
