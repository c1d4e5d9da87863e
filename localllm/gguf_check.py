"""What a GGUF must satisfy before any kernel sees a byte of it.

Three layers, each raising one-line `ModelFormatError`s that name the tensor or key at fault:

* tensor bytes (`tensor_nbytes`, `check_tensor_ranges`): a known ggml type, 1-4 non-zero dimensions,
  rows a whole number of blocks, byte ranges aligned, inside the file and not overlapping;
* metadata (`check_metadata`): the keys localllm reads have the right types, and the hyperparameters
  of the architectures it runs are within sane ranges, so reading them cannot divide by zero;
* the model (`check_model`): relations between hyperparameters (heads divide the embedding, KV heads
  divide heads, rope dims fit a head) and every tensor with a known role has the shape they imply.

The first two run in `GGUFFile.open`; `check_model` runs once a model has read its `ModelArgs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.text_table import TextTable

if TYPE_CHECKING:
    from localllm.gguf_file import GGUFFile, TensorInfo
    from localllm.models.base import ModelArgs

MAX_DIMS = 4  # GGML_MAX_DIMS

# ModelArgs field -> (metadata key under "<arch>.", smallest, largest). The upper bounds are far above
# any published model (vocabularies ~262k, embeddings ~16k, contexts ~10M) and only reject nonsense.
INT_HYPERPARAMETERS: dict[str, tuple[str, int, int]] = {
    "vocab_size": ("vocab_size", 1, 1 << 22),
    "dim": ("embedding_length", 1, 1 << 16),
    "n_layers": ("block_count", 1, 1 << 12),
    "n_heads": ("attention.head_count", 1, 1 << 12),
    "n_kv_heads": ("attention.head_count_kv", 1, 1 << 12),
    "head_dim": ("attention.key_length", 1, 1 << 12),
    "ffn_dim": ("feed_forward_length", 1, 1 << 20),
    "rope_dim": ("rope.dimension_count", 2, 1 << 12),
    "context_length": ("context_length", 1, 1 << 27),
    "sliding_window": ("attention.sliding_window", 0, 1 << 27),
    "experts": ("expert_count", 0, 1 << 12),  # (LayerSpec fields: checked in the metadata only)
    "experts_used": ("expert_used_count", 0, 1 << 12),
    "expert_ffn_dim": ("expert_feed_forward_length", 1, 1 << 20),
    "expert_shared_ffn_dim": ("expert_shared_feed_forward_length", 1, 1 << 20),
}
# ModelArgs field -> (metadata key or None, smallest (exclusive), largest)
FLOAT_HYPERPARAMETERS: dict[str, tuple[str | None, float, float]] = {
    "norm_eps": ("attention.layer_norm_rms_epsilon", 0.0, 1.0),
    "rope_base": ("rope.freq_base", 0.0, 1e12),
    "attn_scale": (None, 0.0, 1e6),
    "embedding_scale": (None, 0.0, 1e6),
    "rope_scaling_factor": ("rope.scaling.factor", 0.0, 1e6),
}
EXTRA_INT_KEYS = {"attention.value_length": (1, 1 << 12)}  # read by no model, but must match head_dim

# Tokenizer keys every architecture shares: key -> what its value must be.
TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.chat_template": "string",
    "tokenizer.ggml.tokens": "strings",
    "tokenizer.ggml.merges": "strings",
    "tokenizer.ggml.token_type": "numbers",
    "tokenizer.ggml.scores": "numbers",
    "general.architecture": "string",
}
TOKEN_ID_KEYS = ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")

# Tensor role -> its shape in numpy order (rows, n_per_row), in sizes named as `_sizes` names them.
# "blk.N." roles repeat per layer. Tensors with other names are not read by any model, so not checked.
TENSOR_SHAPES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("vocab_size", "dim"),
    "output.weight": ("vocab_size", "dim"),
    "output_norm.weight": ("dim",),
    "rope_freqs.weight": ("rope_dim/2",),
    "blk.N.attn_norm.weight": ("dim",),
    "blk.N.attn_q.weight": ("n_heads*head_dim", "dim"),
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
    "blk.N.attn_qkv.weight": ("qkv_rows", "dim"),  # fused q, k, v (phi3)
    "blk.N.ffn_down.weight": ("dim", "ffn_dim"),
    "blk.N.post_ffw_norm.weight": ("dim",),
    "blk.N.ffn_gate_inp.weight": ("experts", "dim"),
    "blk.N.ffn_gate_exps.weight": ("experts", "expert_ffn_dim", "dim"),
    "blk.N.ffn_up_exps.weight": ("experts", "expert_ffn_dim", "dim"),
    "blk.N.ffn_down_exps.weight": ("experts", "dim", "expert_ffn_dim"),
    "blk.N.ffn_gate_inp_shexp.weight": ("dim",),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


# ---------------------------------------------------------------- tensor bytes


def block_layout(ggml_type: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) of a ggml type; None for a type ggml does not define."""
    from localllm.quant import QUANT_TYPES

    qt = QUANT_TYPES.get(ggml_type)
    if qt is not None:
        return qt.block_size, qt.type_size
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # types we only name, not run

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None


def tensor_nbytes(name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    """The bytes a tensor of this type and numpy-order shape takes, or why it cannot exist."""
    if not 1 <= len(shape) <= MAX_DIMS:
        raise ModelFormatError(f"tensor '{name}' has {len(shape)} dimensions; expected 1 to {MAX_DIMS}")
    if min(shape) < 1:
        raise ModelFormatError(f"tensor '{name}' has shape {list(shape)}; every dimension must be >= 1")
    layout = block_layout(ggml_type)
    if layout is None:
        raise ModelFormatError(f"tensor '{name}' has unknown ggml type {ggml_type}")
    block, size = layout
    if shape[-1] % block:
        raise ModelFormatError(
            f"tensor '{name}' has rows of {shape[-1]} values; its type {_type_name(ggml_type)} "
            f"stores rows in blocks of {block}"
        )
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def check_tensor_ranges(
    tensors: Iterable[TensorInfo], data_start: int, alignment: int, file_size: int
) -> None:
    """Each tensor's bytes match its type and shape, start aligned in the data section, end inside
    the file, and no two tensors share a byte (a kernel writing one would corrupt another)."""
    spans = []
    for t in tensors:
        if t.nbytes != tensor_nbytes(t.name, t.ggml_type, t.shape):
            raise ModelFormatError(
                f"tensor '{t.name}' claims {t.nbytes:,} bytes; its type and shape need "
                f"{tensor_nbytes(t.name, t.ggml_type, t.shape):,}"
            )
        if t.offset < data_start or (t.offset - data_start) % alignment:
            raise ModelFormatError(
                f"tensor '{t.name}' starts at byte {t.offset:,}; expected a multiple of {alignment} "
                f"from the data section at byte {data_start:,}"
            )
        if t.offset + t.nbytes > file_size:
            raise ModelFormatError(
                f"the file is truncated: tensor '{t.name}' ends at byte {t.offset + t.nbytes:,} "
                f"but the file has {file_size:,} bytes"
            )
        spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ModelFormatError(f"tensors '{first}' and '{second}' overlap in the file")


# ---------------------------------------------------------------- metadata


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """Types of the keys localllm reads, and ranges of the hyperparameters of architectures it runs."""
    for key, kind in TOKENIZER_KEYS.items():
        if key in metadata and not _is_kind(metadata[key], kind):
            raise ModelFormatError(f"metadata key '{key}' should be {_KIND_WORDS[kind]}")
    for name in TOKEN_ID_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in metadata and not _is_int(metadata[key]):
            raise ModelFormatError(f"metadata key '{key}' should be an integer")
    tokens = metadata.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if tokens is not None and key in metadata and len(metadata[key]) != len(tokens):
            raise ModelFormatError(
                f"metadata key '{key}' has {len(metadata[key]):,} entries for {len(tokens):,} tokens"
            )
    arch = metadata.get("general.architecture")
    if arch in _supported_architectures():
        _check_hyperparameter_keys(metadata, arch)


def _check_hyperparameter_keys(metadata: Mapping[str, Any], arch: str) -> None:
    ints = {key: (lo, hi) for key, lo, hi in INT_HYPERPARAMETERS.values()} | EXTRA_INT_KEYS
    for key, (lo, hi) in ints.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None and not (_is_int(value) and lo <= value <= hi):
            raise ModelFormatError(
                f"metadata key '{arch}.{key}' is {_show(value)}; expected an integer from {lo:,} to {hi:,}"
            )
    for key, lo, hi in FLOAT_HYPERPARAMETERS.values():
        value = metadata.get(f"{arch}.{key}") if key else None
        if value is not None and not (_is_number(value) and lo < value <= hi):
            raise ModelFormatError(
                f"metadata key '{arch}.{key}' is {_show(value)}; expected a number "
                f"above {lo:g} and at most {hi:g}"
            )


def _supported_architectures() -> Iterable[str]:
    from localllm.architectures import ARCHITECTURES

    return ARCHITECTURES


_KIND_WORDS = {"string": "a string", "strings": "an array of strings", "numbers": "an array of numbers"}


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "strings":  # a TextTable holds only strings, checked as UTF-8 when it was read
        return isinstance(value, TextTable) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iuf"
    return isinstance(value, list) and all(_is_number(v) for v in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(ggml_type: int) -> str:
    from localllm.quant import type_name

    return type_name(ggml_type)


# ---------------------------------------------------------------- the model


def check_model(gf: GGUFFile, args: ModelArgs, names: Mapping[str, str] | None = None) -> None:
    """The hyperparameters a model read are consistent, and every tensor with a known role has the
    shape they imply, a type localllm runs, and bytes inside the file. Call it after reading `args`
    and before loading any weight. `names` is an architecture's layer-role renames (models.layers'
    TENSOR_NAMES keys -> file names), so renamed tensors are checked under their new names."""
    try:
        _check_model(gf, args, names)
    except ModelFormatError as e:
        raise ModelFormatError(one_line(f"{gf.path.name}: {e}")) from None


def one_line(message: str) -> str:
    """An error message safe to print: names from the file may hold terminal escape sequences."""
    from localllm.printable import printable

    return printable(message)


def _check_model(gf: GGUFFile, args: ModelArgs, names: Mapping[str, str] | None) -> None:
    check_hyperparameters(args, gf.metadata)
    sizes, shapes = _sizes(args), _shape_table(names)
    for info in gf.tensors.values():
        role = _role(info.name, args.n_layers, shapes)
        if role is not None:
            _check_role(info, shapes[role], sizes)
    for i, shard in enumerate(getattr(gf, "shards", None) or [gf]):  # one file, or each of a split model's
        tensors = [t for t in gf.tensors.values() if getattr(t, "shard", 0) == i]
        check_tensor_ranges(tensors, shard.data_offset, shard.alignment, shard.size)


def check_hyperparameters(args: ModelArgs, metadata: Mapping[str, Any]) -> None:
    """Ranges of each hyperparameter and the relations the kernels rely on. Fields are read with
    getattr, so older and newer ModelArgs (flat rope fields or per-layer specs) both work."""
    arch = getattr(args, "architecture", metadata.get("general.architecture", "?"))
    for field, (key, lo, hi) in INT_HYPERPARAMETERS.items():
        value = getattr(args, field, None)
        if value is not None and not (_is_int(value) and lo <= value <= hi):
            raise ModelFormatError(f"{field} ('{arch}.{key}') is {_show(value)}; expected {lo:,} to {hi:,}")
    for field, (key, lo, hi) in FLOAT_HYPERPARAMETERS.items():
        value = getattr(args, field, None)
        if value is not None and not (_is_number(value) and lo < value <= hi):
            where = f" ('{arch}.{key}')" if key else ""
            raise ModelFormatError(f"{field}{where} is {_show(value)}; expected above {lo:g}, at most {hi:g}")
    for problem in _relation_problems(args, metadata, arch):
        raise ModelFormatError(problem)
    for il, spec in enumerate(getattr(args, "layers", None) or ()):
        for problem in _layer_problems(args, spec):
            raise ModelFormatError(f"layer {il}: {problem}")


def _relation_problems(args: Any, metadata: Mapping[str, Any], arch: str) -> Iterable[str]:
    heads, kv_heads, head_dim, dim = args.n_heads, args.n_kv_heads, args.head_dim, args.dim
    if heads % kv_heads:
        yield f"the KV head count ({kv_heads}) does not divide the head count ({heads})"
    if f"{arch}.attention.key_length" not in metadata and dim % heads:
        yield f"the head count ({heads}) does not divide the embedding length ({dim})"
    value_length = metadata.get(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        yield f"'{arch}.attention.value_length' is {value_length}; expected the head dim, {head_dim}"
    if hasattr(args, "rope_dim"):  # older ModelArgs: one rotation for every layer
        yield from _rope_problems(args.rope_dim, getattr(args, "rope_base", 1.0), 1.0, head_dim)
    layers = getattr(args, "layers", None)
    if layers is not None and len(layers) != args.n_layers:
        yield f"{len(layers)} layer specs for {args.n_layers} layers"
    cap = getattr(args, "final_logit_softcap", 0.0)
    if not (_is_number(cap) and cap >= 0):
        yield f"the final logit softcap is {_show(cap)}; expected a number >= 0"
    n_tokens = len(metadata.get("tokenizer.ggml.tokens") or ())
    if n_tokens > args.vocab_size:
        yield f"the tokenizer has {n_tokens:,} tokens but the model's vocabulary has {args.vocab_size:,}"


def _layer_problems(args: Any, spec: Any) -> Iterable[str]:
    rope = getattr(spec, "rope", None)
    if rope is not None:
        yield from _rope_problems(rope.dim, rope.base, getattr(rope, "freq_scale", 1.0), args.head_dim)
    window = getattr(spec, "window", 0)
    if not (_is_int(window) and 0 <= window <= INT_HYPERPARAMETERS["sliding_window"][2]):
        yield f"the sliding window is {_show(window)}; expected 0 (none) to {1 << 27:,}"
    cap = getattr(spec, "attn_softcap", 0.0)
    if not (_is_number(cap) and cap >= 0):
        yield f"the attention softcap is {_show(cap)}; expected a number >= 0"


def _rope_problems(dim: Any, base: Any, freq_scale: Any, head_dim: int) -> Iterable[str]:
    if not (_is_int(dim) and 2 <= dim <= head_dim and dim % 2 == 0):
        yield f"the rope dimension count is {_show(dim)}; expected an even number, 2 to head dim {head_dim}"
    if not (_is_number(base) and 0 < base <= 1e12):
        yield f"the rope base is {_show(base)}; expected above 0, at most 1e12"
    if not (_is_number(freq_scale) and 0 < freq_scale <= 1e6):
        yield f"the rope frequency scale is {_show(freq_scale)}; expected above 0, at most 1e6"


def _sizes(args: Any) -> dict[str, int]:
    return {
        "vocab_size": args.vocab_size,
        "dim": args.dim,
        "head_dim": args.head_dim,
        "ffn_dim": args.ffn_dim,
        "n_heads*head_dim": args.n_heads * args.head_dim,
        "n_kv_heads*head_dim": args.n_kv_heads * args.head_dim,
        "rope_dim/2": _rope_dim(args) // 2,
        "ffn_up_rows": args.ffn_dim * (2 if getattr(args, "fused_gate_up", False) else 1),
        "qkv_rows": (args.n_heads + 2 * args.n_kv_heads) * args.head_dim,
        **_expert_sizes(args),
    }


def _expert_sizes(args: Any) -> dict[str, int]:
    """The first mixture-of-experts layer's sizes (0 where no layer has experts)."""
    moe = [s for s in getattr(args, "layers", None) or () if getattr(s, "experts", 0)]
    return {
        "experts": moe[0].experts if moe else 0,
        "expert_ffn_dim": moe[0].expert_ffn_dim if moe else 0,
    }


def _rope_dim(args: Any) -> int:
    layers = getattr(args, "layers", None)
    return layers[0].rope.dim if layers else getattr(args, "rope_dim", args.head_dim)


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
