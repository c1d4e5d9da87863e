"""A Hugging Face checkpoint is an untrusted file like a GGUF: what convert reads from it is checked
before anything is allocated from it, and every problem is one LocalLLMError naming the file.

* JSON files: a size cap per file (a 1 GB config.json is not parsed), then types: the top level must
  be an object; NaN, infinities, 5,000-digit numbers and deep nesting are refused as malformed.
* config.json (`check_config`): every hyper-parameter convert reads has the right type and a range
  (the same bounds as a GGUF's, localllm.loading.checks), and the relations the conversion divides by hold.
* tensors (`check_tensors`): unique names, layers below num_hidden_layers, and every tensor with a
  role the shape config.json implies; the embedding has at least vocab_size rows. Its row count then
  bounds every token id (vocab.py), so an id of 4e9 is refused before a list of 4e9 tokens is made.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from localllm.convert.names import gguf_name
from localllm.errors import LocalLLMError
from localllm.loading.checks import INT_HYPERPARAMETERS
from localllm.models.checks import TENSOR_SHAPES

MIB = 1 << 20
# The largest published files are far below these (Gemma 3's tokenizer.json: 33 MiB, tokenizer.model:
# 4.5 MiB); the caps keep a hostile file's parse (~10x its size in Python objects) bounded.
MAX_BYTES = {
    "config.json": 16 * MIB,
    "tokenizer_config.json": 64 * MIB,
    "model.safetensors.index.json": 64 * MIB,
    "tokenizer.json": 256 * MIB,
    "tokenizer.model": 64 * MIB,
}
MAX_VOCAB = INT_HYPERPARAMETERS["vocab_size"][2]


def _bound(key: str) -> tuple[int, int]:
    return INT_HYPERPARAMETERS[key][1:]


# config.json key -> (smallest, largest) of an integer convert reads
INT_KEYS: dict[str, tuple[int, int]] = {
    "vocab_size": _bound("vocab_size"),
    "hidden_size": _bound("dim"),
    "num_hidden_layers": _bound("n_layers"),
    "intermediate_size": _bound("ffn_dim"),
    "num_attention_heads": _bound("n_heads"),
    "num_key_value_heads": _bound("n_kv_heads"),
    "head_dim": _bound("head_dim"),
    "max_position_embeddings": _bound("context_length"),
    "sliding_window": _bound("sliding_window"),
}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads")
# config.json key -> (exclusive smallest, largest) of a float
FLOAT_KEYS: dict[str, tuple[float, float]] = {
    "rope_theta": (0.0, 1e12),
    "rms_norm_eps": (0.0, 1.0),
    "final_logit_softcapping": (0.0, 1e6),
}
ROPE_FLOATS = {"factor": (0.0, 1e6), "low_freq_factor": (0.0, 1e6), "high_freq_factor": (0.0, 1e6)}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint, parsed within its size cap; None when it is not there."""
    limit = MAX_BYTES.get(path.name, 64 * MIB)
    try:
        if not path.is_file():
            return None
        if path.stat().st_size > limit:
            size = path.stat().st_size / MIB
            raise LocalLLMError(f"{path} is {size:,.0f} MiB; at most {limit // MIB} MiB expected")
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant)
        if _SURROGATE.search(text):  # escaped surrogates: fine in pairs, but a lone one is not Unicode
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except UnicodeEncodeError:
        raise LocalLLMError(f"{path} holds a lone surrogate (\\ud800-\\udfff): not Unicode") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError: a ValueError
        raise LocalLLMError(f"cannot read {path}: {_short(e)}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def quoted(value: Any) -> str:
    """A value from a file, for an error message: repr, at most 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_config(config: Any, path: Path) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise LocalLLMError(f"{path} is not a JSON object")
    for key, (lo, hi) in INT_KEYS.items():
        _check_int(config, key, lo, hi, path)
    for key in REQUIRED:
        if config.get(key) is None:
            raise LocalLLMError(f"{path} has no {key}")
    for key, (lo, hi) in FLOAT_KEYS.items():
        _check_float(config, key, lo, hi, path)
    names = config.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise LocalLLMError(f"{path}: architectures is {quoted(names)}; a list of names expected")
    for key in ("model_type", "_name_or_path"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise LocalLLMError(f"{path}: {key} is {quoted(config[key])}; a string expected")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise LocalLLMError(f"{path}: tie_word_embeddings is {quoted(config['tie_word_embeddings'])}")
    _check_relations(config, path)
    _check_rope_scaling(config.get("rope_scaling"), path)
    return config


def _check_int(config: dict[str, Any], key: str, lo: int, hi: int, path: Path) -> None:
    value = config.get(key)
    if value is None:
        return
    if isinstance(value, float) and value.is_integer():
        value = config[key] = int(value)  # 4096.0: some exporters write floats
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LocalLLMError(f"{path}: {key} is {quoted(value)}; an integer from {lo:,} to {hi:,} expected")


def _check_float(config: dict[str, Any], key: str, lo: float, hi: float, path: Path, what: str = "") -> None:
    value = config.get(key)
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo < value <= hi:
        raise LocalLLMError(f"{path}: {what}{key} is {quoted(value)}; a number in ({lo:g}, {hi:g}] expected")


def _check_relations(config: dict[str, Any], path: Path) -> None:
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or dim // heads
    if not config.get("head_dim") and dim % heads:
        raise LocalLLMError(f"{path}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
    if heads % kv:
        raise LocalLLMError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if head_dim % 2:
        raise LocalLLMError(f"{path}: the head size {head_dim} is odd; rotary embeddings need pairs")


def _check_rope_scaling(scaling: Any, path: Path) -> None:
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise LocalLLMError(f"{path}: rope_scaling is {quoted(scaling)}; an object expected")
    kind = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(kind, str):
        raise LocalLLMError(f"{path}: rope_scaling's type is {quoted(kind)}")
    for key, (lo, hi) in ROPE_FLOATS.items():
        _check_float(scaling, key, lo, hi, path, "rope_scaling.")
    _check_int(scaling, "original_max_position_embeddings", *INT_KEYS["max_position_embeddings"], path)
    if kind == "linear" and scaling.get("factor") is None:
        raise LocalLLMError(f"{path}: linear rope_scaling has no factor")
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    if kind == "llama3" and high <= low:
        raise LocalLLMError(
            f"{path}: rope_scaling's high_freq_factor {high} is not above low_freq_factor {low}"
        )


# ---------------------------------------------------------------- the tensor table


def check_tensors(arch: str, config: dict[str, Any], refs: list[Any]) -> int:
    """Every tensor convert maps has the shape config.json implies; returns the embedding's rows,
    the bound on vocab_size and every token id."""
    sizes = _sizes(config)
    rows = None
    for ref in refs:
        name = gguf_name(arch, ref.name)
        if name is None:
            continue
        if name == "token_embd.weight":
            rows = ref.shape[0] if len(ref.shape) == 2 else -1
        _check_shape(ref, name, sizes, config["num_hidden_layers"])
    if rows is None:
        raise LocalLLMError("the checkpoint has no model.embed_tokens.weight")
    vocab = config.get("vocab_size") or 0
    if vocab > rows:
        raise LocalLLMError(f"config.json's vocab_size {vocab:,} is more than the embedding's {rows:,} rows")
    return min(rows, MAX_VOCAB)


def _sizes(config: dict[str, Any]) -> dict[str, int]:
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or dim // heads
    ffn = config.get("intermediate_size") or 0
    return {
        "dim": dim,
        "head_dim": head_dim,
        "ffn_dim": ffn,
        "ffn_up_rows": ffn,
        "n_heads*head_dim": heads * head_dim,
        "n_kv_heads*head_dim": kv * head_dim,
        "rope_dim/2": head_dim // 2,
    }


def _check_shape(ref: Any, name: str, sizes: dict[str, int], n_layers: int) -> None:
    role = name
    if (m := _LAYER.fullmatch(name)) is not None:
        if int(m[1]) >= n_layers:
            raise LocalLLMError(f"tensor {ref.name} is in layer {m[1]}, but num_hidden_layers is {n_layers}")
        role = f"blk.N.{m[2]}"
    if role in ("token_embd.weight", "output.weight"):
        expected: tuple[int | None, ...] = (None, sizes["dim"])  # rows: at least vocab_size
    elif role in TENSOR_SHAPES:
        expected = tuple(sizes[s] for s in TENSOR_SHAPES[role])
    else:
        return
    shape = tuple(ref.shape)
    wrong = len(shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(shape, expected, strict=True)
    )
    if wrong:
        want = ["N" if e is None else e for e in expected]
        raise LocalLLMError(f"tensor {ref.name} has shape {list(shape)}; config.json implies {want}")
    if 0 in shape:
        raise LocalLLMError(f"tensor {ref.name} is empty (shape {list(shape)})")
