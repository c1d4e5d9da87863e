"""What every architecture shares: hyper-parameters read from GGUF metadata, the forward batch, loading."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.errors import ModelFormatError
from localllm.models.batch import ForwardBatch, PagedKV  # noqa: F401 (re-exported)
from localllm.models.spec import Hyper, LayerSpec, ModelArgs, RopeSpec  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.loading.file import GGUFFile


FFN_KEY = "feed_forward_length"


def read_hyper(gf: GGUFFile, per_layer: tuple[str, ...] = ()) -> Hyper:
    """The shared hyper-parameters; a key of `per_layer` may give one value per layer (the model then
    reads them into its LayerSpecs), of which Hyper keeps the first."""
    n_heads = int(_need(gf, "attention.head_count"))
    dim = int(_need(gf, "embedding_length"))
    if n_heads <= 0:
        raise ModelFormatError(f"{gf.path.name}: '{gf.architecture}.attention.head_count' must be positive")
    vocab = gf.arch_get("vocab_size") or len(gf.get("tokenizer.ggml.tokens", []))
    embd, kv_key, ffn_key = gf.tensors.get("token_embd.weight"), "attention.head_count_kv", FFN_KEY
    return Hyper(
        vocab_size=int(vocab or (embd.shape[0] if embd else 0)),
        dim=dim,
        n_layers=int(_need(gf, "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_first(gf, kv_key, gf.arch_get(kv_key, n_heads), per_layer)),
        head_dim=int(gf.arch_get("attention.key_length", dim // n_heads)),
        ffn_dim=int(_first(gf, ffn_key, _need(gf, ffn_key, per_layer), per_layer)),
        norm_eps=float(gf.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=trained_context(gf),
    )


def trained_context(gf: GGUFFile) -> int:
    """The context the model was trained on (`<arch>.context_length`; llama.cpp's 2048 when absent)."""
    value = gf.arch_get("context_length", 2048)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 2048


ROPE_KINDS = ("none", "linear", "yarn")
# Tensors read into the specs (RoPE factors) rather than loaded as weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def read_rope(
    gf: GGUFFile, h: Hyper, neox: bool, base: float | None = None, factors_tensor: str = "rope_freqs.weight"
) -> RopeSpec:
    """The file's rotation; `base` overrides rope.freq_base. Linear and YaRN scaling and per-pair
    frequency factors (Llama 3's `rope_freqs.weight`, or the tensor `factors_tensor` names) are
    honoured; other scaling kinds are refused rather than run without them."""
    kind = str(gf.arch_get("rope.scaling.type", "none"))
    factor = float(gf.arch_get("rope.scaling.factor", 1.0) or 1.0)
    if kind not in ROPE_KINDS and factor != 1.0:
        raise ModelFormatError(
            f"{gf.path.name} uses '{kind}' RoPE scaling ({gf.architecture}.rope.scaling.type), "
            "which localllm does not support yet"
        )
    yarn = kind == "yarn" and factor != 1.0
    dim, factors = int(gf.arch_get("rope.dimension_count", h.head_dim)), read_factors(gf, factors_tensor)
    if factors and len(factors) != dim // 2:
        raise ModelFormatError(
            f"{gf.path.name}: tensor '{factors_tensor}' has {len(factors)} RoPE factors; expected {dim // 2}"
        )
    return RopeSpec(
        dim=dim,
        base=float(base if base is not None else gf.arch_get("rope.freq_base", 10000.0)),
        freq_scale=1.0 / factor if kind in ("linear", "yarn") else 1.0,
        neox=neox,
        factors=factors,
        attn_factor=float(gf.arch_get("rope.scaling.attn_factor", 1.0)),
        yarn_orig_ctx=int(gf.arch_get("rope.scaling.original_context_length", h.context_length)) * yarn,
        yarn_beta_fast=float(gf.arch_get("rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(gf.arch_get("rope.scaling.yarn_beta_slow", 1.0)),
    )


def read_factors(gf: GGUFFile, name: str) -> tuple[float, ...]:
    """A per-pair RoPE factor tensor as a tuple (hashable: it is part of the spec), () if absent."""
    from localllm.quant import dequantize

    if name not in gf.tensors:
        return ()
    values = dequantize(gf.raw(name), gf.tensors[name].ggml_type).reshape(-1)
    if not np.all(np.isfinite(values) & (values > 0)):
        raise ModelFormatError(f"{gf.path.name}: tensor '{name}' has RoPE factors that are not all positive")
    return tuple(float(v) for v in values)


def read_moe(gf: GGUFFile, h: Hyper, expert_ffn_key: str | None, renorm: bool) -> dict[str, Any]:
    """The LayerSpec fields of a mixture-of-experts FFN ({} for a dense one): `<arch>.expert_count`
    experts, `expert_used_count` per token, each `expert_ffn_key` wide (None: feed_forward_length, as
    Mixtral's llama files; else as llama.cpp, feed_forward_length / experts used where absent)."""
    experts = int(gf.arch_get("expert_count", 0) or 0)
    if not experts:
        return {}
    used = int(gf.arch_get("expert_used_count", 0) or 0)
    if not 0 < used <= experts:
        raise ModelFormatError(
            f"{gf.path.name}: '{gf.architecture}.expert_used_count' is {used}; expected 1 to {experts} "
            "(the expert count)"
        )
    width = h.ffn_dim if expert_ffn_key is None else \
        int(_scalar(gf, expert_ffn_key, gf.arch_get(expert_ffn_key, h.ffn_dim // used)))  # fmt: skip
    return {"experts": experts, "experts_used": used, "expert_ffn_dim": width, "expert_renorm": renorm}


def make_args(gf: GGUFFile, h: Hyper, layers: list[LayerSpec], **model_fields: Any) -> ModelArgs:
    """ModelArgs from the shared hyper-parameters, one spec per layer and model-level fields."""
    if len(layers) != h.n_layers:
        raise ValueError("one LayerSpec per layer")
    return ModelArgs(
        architecture=gf.architecture,
        **{f: getattr(h, f) for f in Hyper.__slots__},
        **{
            "attn_scale": 1.0 / math.sqrt(h.head_dim) if h.head_dim > 0 else 1.0,
            "layers": tuple(layers),
            "tied_output": "output.weight" not in gf.tensors,
            "spec_tensors": tuple(n for n in ROPE_TENSORS if n in gf.tensors),
            **model_fields,
        },
    )


def has_layer_tensor(gf: GGUFFile, il: int, name: str) -> bool:
    """Whether layer il carries an optional tensor (biases, q/k norms) that llama-family files may have."""
    return f"blk.{il}.{name}.weight" in gf.tensors or f"blk.{il}.{name}" in gf.tensors


def _need(gf: GGUFFile, key: str, per_layer: tuple[str, ...] = ()) -> Any:
    value = gf.arch_get(key)
    if value is None:
        raise ModelFormatError(f"{gf.path.name} lacks the metadata key '{gf.architecture}.{key}'")
    return value if key in per_layer else _scalar(gf, key, value)


def per_layer_values(gf: GGUFFile, key: str, n_layers: int, default: Any) -> list[Any]:
    """`<arch>.key` as one value per layer: an array of n_layers values, or one value for all."""
    value = gf.arch_get(key, default)
    if not isinstance(value, (list, np.ndarray)):
        return [value] * n_layers
    if len(value) != n_layers:
        raise ModelFormatError(
            f"{gf.path.name}: '{gf.architecture}.{key}' has {len(value)} values for {n_layers} layers"
        )
    return [v.item() if hasattr(v, "item") else v for v in value]


def _first(gf: GGUFFile, key: str, value: Any, per_layer: tuple[str, ...]) -> Any:
    """value, or the first of its per-layer values where the model reads `key` per layer."""
    if key in per_layer and isinstance(value, (list, np.ndarray)) and len(value):
        return value[0]
    return _scalar(gf, key, value)


def _scalar(gf: GGUFFile, key: str, value: Any) -> Any:
    """value, refusing by name one value per layer (which the loading checks let through)."""
    if isinstance(value, (list, np.ndarray)):
        raise ModelFormatError(
            f"{gf.path.name}: '{gf.architecture}.{key}' gives one value per layer, which localllm's "
            f"{gf.architecture} model does not run yet"
        )
    return value


class WeightLoader:
    """Reads named tensors from a GGUF through a backend, checking that their types are supported;
    matrices through `cache`, the backend's disk cache of prepared weights, when there is one."""

    def __init__(self, gf: GGUFFile, backend: Backend, cache: Any = None):
        self.gf = gf
        self.backend = backend
        self.cache = cache
        self.read: set[str] = set()

    def check_all_read(self, also: tuple[str, ...] = ()) -> None:
        """Refuse a file with tensors the model did not read: ignoring one (Llama 3's rope_freqs once)
        would run a different model than the file describes, without a word."""
        left = sorted(set(self.gf.tensors) - self.read - set(also))
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ModelFormatError(
                f"{self.gf.path.name} has the tensor '{left[0]}'{more}, which localllm's "
                f"{self.gf.architecture} model does not use; refusing rather than running without it"
            )

    def matrix(self, name: str, rows: tuple[int, int] | np.ndarray | None = None) -> Any:
        """A weight matrix, or the row range `rows` of one (a fused tensor's part), or the rows of
        the id array `rows` (a part interleaved with another: Backend.prepare_rows)."""
        raw = self.gf.raw(self._checked(name))
        if isinstance(rows, np.ndarray):
            if rows.size == 0 or rows.min() < 0 or rows.max() >= raw.shape[0]:
                raise ModelFormatError(f"{self.gf.path.name}: '{name}' has only {raw.shape[0]} rows")
            return self.backend.prepare_rows(raw, rows, self.gf.tensors[name].ggml_type, self.cache)
        if rows is not None:
            if not 0 <= rows[0] < rows[1] <= raw.shape[0]:
                raise ModelFormatError(f"{self.gf.path.name}: '{name}' has no rows {rows[0]}:{rows[1]}")
            raw = raw[rows[0] : rows[1]]
        return self.backend.prepare_weight(raw, self.gf.tensors[name].ggml_type, self.cache)

    def experts(self, name: str, rows: tuple[int, int] | None = None) -> tuple[Any, ...]:
        """A (experts, rows, cols) tensor as one prepared matrix per expert: a kernel given the routed
        experts' matrices reads only their bytes. rows: that row range of each (a fused tensor's part)."""
        raw = self.gf.raw(self._checked(name))
        if raw.ndim != 3:
            raise ModelFormatError(f"{self.gf.path.name}: '{name}' should have 3 dimensions, not {raw.ndim}")
        if rows is not None:
            if not 0 <= rows[0] < rows[1] <= raw.shape[1]:
                raise ModelFormatError(f"{self.gf.path.name}: '{name}' has no rows {rows[0]}:{rows[1]}")
            raw = raw[:, rows[0] : rows[1]]
        ggml_type = self.gf.tensors[name].ggml_type
        return tuple(self.backend.prepare_weight(raw[e], ggml_type, self.cache) for e in range(raw.shape[0]))

    def ones(self, n: int) -> Any:
        """A float32 vector of n ones, as the backend holds vectors (a weightless norm's weight)."""
        return self.backend.prepare_vector(np.ones(n, np.float32), 0)

    def vector(self, name: str) -> Any:
        return self.backend.prepare_vector(self.gf.raw(self._checked(name)), self.gf.tensors[name].ggml_type)

    def _checked(self, name: str) -> str:
        from localllm.quant import is_supported, type_name

        if name not in self.gf.tensors:
            raise ModelFormatError(f"{self.gf.path.name} lacks the tensor '{name}'")
        self.read.add(name)
        ggml_type = self.gf.tensors[name].ggml_type
        if not is_supported(ggml_type):
            raise ModelFormatError(
                f"tensor '{name}' in {self.gf.path.name} uses type {type_name(ggml_type)}, "
                "which localllm does not support"
            )
        return name
