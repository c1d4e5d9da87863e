"""What a GGUF file must satisfy before any tensor is handed out, checked as the header is read.

Two layers, each raising one-line `ModelFormatError`s that name the tensor or key at fault:

* tensor bytes (`tensor_nbytes`, `check_tensor_ranges`): a known ggml type, 1-4 non-zero dimensions,
  rows a whole number of blocks, byte ranges aligned, inside the file and not overlapping;
* metadata (`check_metadata`): the keys localllm reads have the right types, and the hyperparameters
  of the architectures it runs are within sane ranges, so reading them cannot divide by zero.

Both run in `GGUFFile.open` (`validate_index`); the model's own shape checks, once it has read its
`ModelArgs`, are `localllm.models.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.loading.index import GGUFIndex, TensorInfo
from localllm.text_table import TextTable

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
# Keys llama.cpp also reads as one value per layer (get_key_or_arr): an array passes these checks when
# each value does; a model that cannot run per-layer values refuses them by name (models/base.py).
PER_LAYER_KEYS = frozenset(
    {"attention.head_count", "attention.head_count_kv", "feed_forward_length", "expert_feed_forward_length"}
)

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
        if key in metadata and not is_int(metadata[key]):
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
        values = list(value) if key in PER_LAYER_KEYS and isinstance(value, (list, np.ndarray)) else [value]
        if value is not None and not all(is_int(v) and lo <= v <= hi for v in values):
            raise ModelFormatError(
                f"metadata key '{arch}.{key}' is {show(value)}; expected an integer from {lo:,} to {hi:,}"
            )
    for key, lo, hi in FLOAT_HYPERPARAMETERS.values():
        value = metadata.get(f"{arch}.{key}") if key else None
        if value is not None and not (is_number(value) and lo < value <= hi):
            raise ModelFormatError(
                f"metadata key '{arch}.{key}' is {show(value)}; expected a number "
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
    return isinstance(value, list) and all(is_number(v) for v in value)


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(ggml_type: int) -> str:
    from localllm.quant import type_name

    return type_name(ggml_type)


def validate_index(index: GGUFIndex, file_size: int) -> None:
    """A parsed (or cached) index passes the metadata and tensor-range checks for a file this big."""
    check_metadata(index.metadata)
    check_tensor_ranges(index.tensors.values(), index.data_offset, index.alignment, file_size)


def one_line(message: str) -> str:
    """An error message safe to print: names from the file may hold terminal escape sequences."""
    from localllm.printable import printable

    return printable(message)
