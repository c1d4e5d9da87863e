"""What a model's hyperparameters and tensors must satisfy once it has read its `ModelArgs`.

`check_model` checks relations between hyperparameters (heads divide the embedding, KV heads divide
heads, rope dims fit a head) and that every tensor with a known role has the shape they imply; the
file-level checks it builds on (ranges, tensor bytes) are `localllm.loading.checks`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from localllm.errors import ModelFormatError
from localllm.loading.checks import (
    FLOAT_HYPERPARAMETERS,
    INT_HYPERPARAMETERS,
    check_tensor_ranges,
    is_int,
    is_number,
    one_line,
    show,
)
from localllm.loading.file import GGUFFile
from localllm.loading.index import TensorInfo
from localllm.models.spec import LayerSpec, ModelArgs

# Tensor role -> its shape in numpy order (rows, n_per_row), in sizes named as `_sizes` names them.
# "blk.N." roles repeat per layer. Tensors with other names are not read by any model, so not checked.
TENSOR_SHAPES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("vocab_size", "dim"),
    "output.weight": ("vocab_size", "dim"),
    "output_norm.weight": ("dim",),
    "rope_freqs.weight": ("rope_dim/2",),
    "blk.N.attn_norm.weight": ("dim",),
    "blk.N.attn_q.weight": ("n_heads*head_dim", "dim"),  # 2*n_heads*head_dim with per-head gates (qwen35)
    "blk.N.attn_k.weight": ("n_kv_heads*head_dim", "dim"),
    "blk.N.attn_v.weight": ("n_kv_heads*head_dim", "dim"),
    "blk.N.attn_output.weight": ("dim", "n_heads*head_dim"),
    "blk.N.attn_q.bias": ("n_heads*head_dim",),
    "blk.N.attn_k.bias": ("n_kv_heads*head_dim",),
    "blk.N.attn_v.bias": ("n_kv_heads*head_dim",),
    "blk.N.attn_output.bias": ("dim",),
    "blk.N.attn_q_norm.weight": ("head_dim",),
    "blk.N.attn_k_norm.weight": ("head_dim",),
    "blk.N.post_attention_norm.weight": ("dim",),
    "blk.N.ffn_norm.weight": ("dim",),
    "blk.N.ffn_gate.weight": ("ffn_dim", "dim"),
    "blk.N.ffn_up.weight": ("ffn_up_rows", "dim"),  # 2 * ffn_dim where gate and up are fused (phi3)
    "blk.N.attn_qkv.weight": ("qkv_rows", "dim"),  # fused q, k, v (phi3); a Gated DeltaNet's conv input
    "blk.N.ffn_down.weight": ("dim", "ffn_dim"),
    "blk.N.post_ffw_norm.weight": ("dim",),
    "blk.N.layer_output_scale.weight": ("one",),
    "blk.N.ffn_gate_inp.weight": ("experts", "dim"),
    "blk.N.ffn_gate_exps.weight": ("experts", "expert_ffn_dim", "dim"),
    "blk.N.ffn_up_exps.weight": ("experts", "expert_ffn_dim", "dim"),
    "blk.N.ffn_down_exps.weight": ("experts", "dim", "expert_ffn_dim"),
    "blk.N.ffn_gate_inp_shexp.weight": ("dim",),
    # Gated DeltaNet (qwen35, qwen3next)
    "blk.N.attn_gate.weight": ("ssm_inner", "dim"),
    "blk.N.ssm_beta.weight": ("ssm_v_heads", "dim"),
    "blk.N.ssm_alpha.weight": ("ssm_v_heads", "dim"),
    "blk.N.ssm_ba.weight": ("2*ssm_v_heads", "dim"),
    "blk.N.ssm_conv1d.weight": ("ssm_channels", "ssm_conv"),
    "blk.N.ssm_dt.bias": ("ssm_v_heads",),
    "blk.N.ssm_a": ("ssm_v_heads",),
    "blk.N.ssm_norm.weight": ("ssm_head_dim",),
    "blk.N.ssm_out.weight": ("dim", "ssm_inner"),
    "blk.N.attn_sinks.weight": ("n_heads",),
    "blk.N.ffn_gate_inp.bias": ("experts",),
    "blk.N.ffn_gate_exps.bias": ("experts", "expert_ffn_dim"),
    "blk.N.ffn_up_exps.bias": ("experts", "expert_ffn_dim"),
    "blk.N.ffn_down_exps.bias": ("experts", "dim"),
    "blk.N.ffn_gate_up_exps.weight": ("experts", "2*expert_ffn_dim", "dim"),  # gemma4
    "blk.N.ffn_gate_inp.scale": ("dim",),
    "blk.N.ffn_down_exps.scale": ("experts",),
    "blk.N.pre_ffw_norm_2.weight": ("dim",),
    "blk.N.post_ffw_norm_1.weight": ("dim",),
    "blk.N.post_ffw_norm_2.weight": ("dim",),
    "per_layer_token_embd.weight": ("vocab_size", "n_layers*per_layer_dim"),
    "per_layer_model_proj.weight": ("n_layers*per_layer_dim", "dim"),
    "per_layer_proj_norm.weight": ("per_layer_dim",),
    "blk.N.inp_gate.weight": ("per_layer_dim", "dim"),
    "blk.N.proj.weight": ("dim", "per_layer_dim"),
    "blk.N.post_norm.weight": ("dim",),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def check_model(gf: GGUFFile, args: ModelArgs, names: Mapping[str, str] | None = None) -> None:
    """The hyperparameters a model read are consistent, and every tensor with a known role has the
    shape they imply, a type localllm runs, and bytes inside the file. Call it after reading `args`
    and before loading any weight. `names` is an architecture's layer-role renames (models.layers'
    TENSOR_NAMES keys -> file names), so renamed tensors are checked under their new names."""
    try:
        _check_model(gf, args, names)
    except ModelFormatError as e:
        raise ModelFormatError(one_line(f"{gf.path.name}: {e}")) from None


def _check_model(gf: GGUFFile, args: ModelArgs, names: Mapping[str, str] | None) -> None:
    check_hyperparameters(args, gf.metadata)
    sizes, shapes = _sizes(args), _shape_table(names)
    # each named layer's own sizes (gemma4's differ), made for the layers the file's tensors name: a
    # corrupt block_count must cost no memory before the missing tensors refuse the file
    per_layer: dict[int, dict[str, int]] = {}
    if any(s.attn_gate for s in args.layers):  # q's projection also holds each head's gate
        shapes = {**shapes, "blk.N.attn_q.weight": ("2*n_heads*head_dim", "dim")}
    for info in gf.tensors.values():
        if info.name in args.spec_tensors and info.name.startswith("blk."):
            continue  # a layer the model does not run (multi-token prediction), not loaded
        role = _role(info.name, args.n_layers, shapes)
        if role is not None:
            match = _LAYER_NAME.fullmatch(info.name)
            il = int(match[1]) if match else -1
            if match and il not in per_layer:
                per_layer[il] = _sizes(args, il)
            _check_role(info, shapes[role], per_layer[il] if match else sizes)
    for i, shard in enumerate(gf.shards):  # one file, or each of a split model's
        tensors = [t for t in gf.tensors.values() if t.shard == i]
        check_tensor_ranges(tensors, shard.data_offset, shard.alignment, shard.size)


def check_hyperparameters(args: ModelArgs, metadata: Mapping[str, Any]) -> None:
    """Ranges of each hyperparameter and the relations the kernels rely on. The range tables name
    metadata keys too (per-layer ones among them), so a field ModelArgs lacks is skipped."""
    arch = args.architecture
    for field, (key, lo, hi) in INT_HYPERPARAMETERS.items():
        value = getattr(args, field, None)
        if value is not None and not (is_int(value) and lo <= value <= hi):
            raise ModelFormatError(f"{field} ('{arch}.{key}') is {show(value)}; expected {lo:,} to {hi:,}")
    for field, (fkey, flo, fhi) in FLOAT_HYPERPARAMETERS.items():  # own names: other types than above
        value = getattr(args, field, None)
        if value is not None and not (is_number(value) and flo < value <= fhi):
            where = f" ('{arch}.{fkey}')" if fkey else ""
            raise ModelFormatError(
                f"{field}{where} is {show(value)}; expected above {flo:g}, at most {fhi:g}"
            )
    for problem in _relation_problems(args, metadata, arch):
        raise ModelFormatError(problem)
    for il, spec in enumerate(args.layers):
        for problem in _layer_problems(args, spec):
            raise ModelFormatError(f"layer {il}: {problem}")


def _relation_problems(args: ModelArgs, metadata: Mapping[str, Any], arch: str) -> Iterable[str]:
    heads, head_dim, dim = args.n_heads, args.head_dim, args.dim
    for kv_heads in sorted({args.kv_heads_of(il) for il in range(len(args.layers))} | {args.n_kv_heads}):
        if kv_heads <= 0 or heads % kv_heads:
            yield f"the KV head count ({kv_heads}) does not divide the head count ({heads})"
    if f"{arch}.attention.key_length" not in metadata and dim % heads:
        yield f"the head count ({heads}) does not divide the embedding length ({dim})"
    value_length = metadata.get(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        yield f"'{arch}.attention.value_length' is {value_length}; expected the head dim, {head_dim}"
    if len(args.layers) != args.n_layers:
        yield f"{len(args.layers)} layer specs for {args.n_layers} layers"
    cap = args.final_logit_softcap
    if not (is_number(cap) and cap >= 0):
        yield f"the final logit softcap is {show(cap)}; expected a number >= 0"
    n_tokens = len(metadata.get("tokenizer.ggml.tokens") or ())
    if n_tokens > args.vocab_size:
        yield f"the tokenizer has {n_tokens:,} tokens but the model's vocabulary has {args.vocab_size:,}"


def _layer_problems(args: ModelArgs, spec: LayerSpec) -> Iterable[str]:
    rope = spec.rope
    yield from _rope_problems(rope.dim, rope.base, rope.freq_scale, spec.head_dim or args.head_dim)
    for name, lo, hi in (("head_dim", 0, 1 << 12), ("kv_heads", 0, 1 << 12), ("ffn_dim", 0, 1 << 20)):
        value = getattr(spec, name)
        if not (is_int(value) and lo <= value <= hi):
            yield f"the layer's {name} is {show(value)}; expected {lo} (the model's) to {hi:,}"
    window = spec.window
    if not (is_int(window) and 0 <= window <= INT_HYPERPARAMETERS["sliding_window"][2]):
        yield f"the sliding window is {show(window)}; expected 0 (none) to {1 << 27:,}"
    cap = spec.attn_softcap
    if not (is_number(cap) and cap >= 0):
        yield f"the attention softcap is {show(cap)}; expected a number >= 0"


def _rope_problems(dim: Any, base: Any, freq_scale: Any, head_dim: int) -> Iterable[str]:
    if not (is_int(dim) and 0 <= dim <= head_dim and dim % 2 == 0):  # 0: a layer without RoPE
        yield f"the rope dimension count is {show(dim)}; expected an even number, 0 to head dim {head_dim}"
    if not (is_number(base) and 0 < base <= 1e12):
        yield f"the rope base is {show(base)}; expected above 0, at most 1e12"
    if not (is_number(freq_scale) and 0 < freq_scale <= 1e6):
        yield f"the rope frequency scale is {show(freq_scale)}; expected above 0, at most 1e6"


def _sizes(args: ModelArgs, il: int | None = None) -> dict[str, int]:
    """The named sizes, of layer il where given (its own head dim, KV heads and FFN width)."""
    hd, kvh, ffn = (args.head_dim, args.n_kv_heads, args.ffn_dim) if il is None else \
        (args.head_dim_of(il), args.kv_heads_of(il), args.ffn_dim_of(il))  # fmt: skip
    return {
        "vocab_size": args.vocab_size,
        "one": 1,
        "dim": args.dim,
        "head_dim": hd,
        "n_heads": args.n_heads,
        "ffn_dim": ffn,
        "n_heads*head_dim": args.n_heads * hd,
        "n_kv_heads*head_dim": kvh * hd,
        "rope_dim/2": _rope_dim(args) // 2,
        "ffn_up_rows": ffn * (2 if args.fused_gate_up else 1),
        "qkv_rows": (args.n_heads + 2 * kvh) * hd,
        "per_layer_dim": args.per_layer_dim,
        "n_layers*per_layer_dim": args.n_layers * args.per_layer_dim,
        "2*n_heads*head_dim": 2 * args.n_heads * hd,
        **_expert_sizes(args, il),
        **_ssm_sizes(args),
    }


def _ssm_sizes(args: ModelArgs) -> dict[str, int]:
    """The first Gated DeltaNet layer's sizes (its conv input replaces phi3's fused qkv rows)."""
    spec = next((s for s in args.layers if s.mixer == "gated_delta_net"), None)
    n_v, d = (spec.ssm_v_heads, spec.ssm_head_dim) if spec is not None else (0, 0)
    channels = (2 * spec.ssm_k_heads + n_v) * d if spec is not None else 0
    fused = {"qkv_rows": channels} if spec is not None else {}
    return {**fused, "ssm_channels": channels, "ssm_conv": spec.ssm_conv if spec else 0, "ssm_inner": n_v * d,
            "ssm_v_heads": n_v, "2*ssm_v_heads": 2 * n_v, "ssm_head_dim": d}  # fmt: skip


def _expert_sizes(args: ModelArgs, il: int | None = None) -> dict[str, int]:
    """Layer il's expert sizes where it has experts, else the first mixture-of-experts layer's (0 where
    no layer has experts)."""
    moe = [s for s in args.layers if s.experts]
    if il is not None and args.layers[il].experts:
        moe = [args.layers[il]]
    f = moe[0].expert_ffn_dim if moe else 0
    return {"experts": moe[0].experts if moe else 0, "expert_ffn_dim": f, "2*expert_ffn_dim": 2 * f}


def _rope_dim(args: ModelArgs) -> int:
    """The rotated dims rope_freqs.weight serves: the first layer with factors (gemma4's full layers)."""
    with_factors = [s.rope.dim for s in args.layers if s.rope.factors]
    return with_factors[0] if with_factors else args.layers[0].rope.dim if args.layers else args.head_dim


def _shape_table(names: Mapping[str, str] | None) -> dict[str, tuple[str, ...]]:
    """TENSOR_SHAPES plus the layer roles an architecture renamed, under their new names."""
    if not names:
        return TENSOR_SHAPES
    from localllm.architectures import TENSOR_NAMES

    table = dict(TENSOR_SHAPES)
    for role, file_name in names.items():
        default = TENSOR_NAMES.get(role)
        if default is not None and f"blk.N.{default}" in TENSOR_SHAPES:
            table[f"blk.N.{file_name}"] = TENSOR_SHAPES[f"blk.N.{default}"]
    return table


def _role(name: str, n_layers: int, shapes: Mapping[str, tuple[str, ...]]) -> str | None:
    """The shape-table role of a tensor name (None: not one a model reads)."""
    if name in shapes:
        return name
    match = _LAYER_NAME.fullmatch(name)
    if match is None or f"blk.N.{match[2]}" not in shapes:
        return None
    if int(match[1]) >= n_layers:  # a layer the model would never run: block_count was changed
        raise ModelFormatError(
            f"tensor '{name}' belongs to layer {int(match[1])}, but block_count says {n_layers} layers"
        )
    return f"blk.N.{match[2]}"


def _check_role(info: TensorInfo, names: tuple[str, ...], sizes: dict[str, int]) -> None:
    from localllm.quant import is_supported, unsupported_message

    expected = tuple(sizes[n] for n in names)
    if tuple(info.shape) != expected:
        implied = ", ".join(f"{n}={sizes[n]}" for n in names)
        raise ModelFormatError(
            f"tensor '{info.name}' has shape {list(info.shape)}; the metadata implies [{implied}]"
        )
    if not is_supported(info.ggml_type):
        raise ModelFormatError(f"tensor '{info.name}': {unsupported_message(info.ggml_type)}")
