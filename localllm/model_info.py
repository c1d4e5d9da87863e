"""What a GGUF file holds and what running it costs: a metadata summary and memory arithmetic.

Read from the metadata and the tensor table alone (no weights are touched, no model is built), so it
works for architectures the engine does not run, and `localllm list` can afford it for every file.

Memory, as this engine uses it:
  * weights: the file itself, memory-mapped (pages are read in as they are first touched);
  * KV cache: keys and values for every layer, stored as f16 by default (--cache-type-k/-v) -
    2 x n_layers x n_kv_heads x head_dim x 2 bytes per token of context (q8_0: 34 bytes per 32 values);
    in a hybrid model (qwen35, qwen3next) only its attention layers write any (the others' pages are
    never touched);
  * recurrent state (hybrid models): per sequence, each Gated DeltaNet layer's conv window and
    delta-rule state in float32, for every sequence the engine may run plus one, and the prefix cache's
    snapshots (engine/state_cache.py);
  * runtime: what the CPU back end holds beside those (Python with NumPy, Numba and LLVM, the loaded
    kernels, the engine's objects: RUNTIME_BYTES, measured), and a prompt chunk's float32 scratch in a
    prefill step (activation_bytes_per_token, an upper bound: docs/benchmarks.md, "What info predicts").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from localllm.config import PROMPT_CHUNK
from localllm.engine.kv_cache import DEFAULT_CACHE_TYPE, KVLayout
from localllm.printable import printable

F16_KV = (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE)  # the engine's default K and V element types
RUNTIME_BYTES = 160 * 2**20  # the CPU back end's own resident memory, measured (see the docstring)


@dataclass(frozen=True, slots=True)
class TensorTypeCount:
    type: str  # "Q8_0", "F32", ...
    count: int  # tensors of this type
    parameters: int  # elements in them
    bytes: int  # bytes they take in the file


@dataclass(frozen=True)
class ModelInfo:
    path: str
    file_size: int
    name: str
    architecture: str
    parameters: int
    quant: str  # the file's quantization: general.file_type, else the type holding most parameters
    tensor_types: list[TensorTypeCount]  # largest share of the file first
    context_length: int | None
    embedding_length: int | None
    n_layers: int | None
    n_heads: int | None
    n_kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    tokenizer: str | None
    chat_template: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # a few more general.* facts when present
    recurrent_layers: int = 0  # layers keeping a per-sequence state instead of keys and values
    state_bytes_per_sequence: int = 0  # their state, float32
    ffn_length: int | None = None  # the dense FFN's width (the widest layer's)
    experts_used: int = 0  # routed experts per token (0: dense), each expert_ffn wide
    expert_ffn: int | None = None

    @property
    def activation_bytes_per_token(self) -> int | None:
        """A prompt token's float32 scratch in a prefill step, at most: q and the attention output, k, v
        and normed k; four model-wide rows (the normed input, the attention's projection, the FFN's
        output and a two-pass down projection's second sum); five FFN-wide rows (gate, up, activation,
        a two-pass down projection's input twice), or the routed experts' rows where wider. None:
        unknown sizes."""
        dims = (self.embedding_length, self.n_heads, self.n_kv_heads, self.head_dim)
        if any(d is None for d in dims):
            return None
        dim, nq, nkv, hd = dims  # type: ignore[misc]
        attention = 2 * nq * hd + 3 * nkv * hd + 4 * dim
        ffn = 5 * (self.ffn_length or 0)
        if self.experts_used:
            ffn = max(ffn, self.experts_used * (2 * dim + 3 * (self.expert_ffn or 0)))
        return 4 * (attention + ffn)

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self.kv_bytes_per_token_as(F16_KV)

    def kv_bytes_per_token_as(self, cache_types: tuple[str, str]) -> int | None:
        """Keys and values of one token in these cache types (None: unknown dims); a hybrid model's
        recurrent layers keep none."""
        if self.n_layers is None or self.n_kv_heads is None or self.head_dim is None:
            return None
        layers = self.n_layers - self.recurrent_layers
        return kv_bytes_per_token(layers, self.n_kv_heads, self.head_dim, cache_types)

    def memory(
        self, ctx_size: int | None = None, cache_types: tuple[str, str] = F16_KV, max_num_seqs: int = 16
    ) -> dict[str, Any]:
        """Bytes needed at `ctx_size` tokens of context (default: the model's trained context) with a
        KV cache of `cache_types`, and the recurrent state pool of a hybrid model sized for
        `max_num_seqs` sequences (plus one)."""
        ctx = ctx_size or self.context_length or 0
        per_token = self.kv_bytes_per_token_as(cache_types)
        kv = per_token * ctx if per_token is not None else None
        from localllm.engine.state_cache import pool_slots, snapshot_slots

        slots = (
            pool_slots(max_num_seqs) + snapshot_slots(max_num_seqs) if self.state_bytes_per_sequence else 0
        )
        pool = self.state_bytes_per_sequence * slots
        state = {"state_bytes_per_sequence": self.state_bytes_per_sequence, "state_slots": slots,
                 "state_pool_bytes": pool} if pool else {}  # fmt: skip
        chunk = min(ctx, PROMPT_CHUNK) if ctx else PROMPT_CHUNK
        scratch = chunk * (self.activation_bytes_per_token or 0)
        runtime = RUNTIME_BYTES + scratch
        return {
            "weights_bytes": self.file_size,
            "kv_cache_types": list(cache_types),
            "kv_bytes_per_token": per_token,
            "context": ctx,
            "kv_cache_bytes": kv,
            **state,
            "prompt_chunk": chunk,
            "scratch_bytes": scratch,  # the prompt chunk's, per model (the runtime's rest is per process)
            "runtime_bytes": runtime,
            "total_bytes": self.file_size + (kv or 0) + pool + runtime,
        }

    def as_dict(self, ctx_size: int | None = None, cache_types: tuple[str, str] = F16_KV) -> dict[str, Any]:
        data = asdict(self)
        data["tensor_types"] = {
            t.type: {k: v for k, v in asdict(t).items() if k != "type"} for t in self.tensor_types
        }
        data["memory"] = self.memory(ctx_size, cache_types)
        return data


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether weights, KV cache, state and runtime fit this machine's RAM, and a sentence saying so."""

    verdict: str  # "fits" | "tight" (more than is free now, less than installed) | "too big"
    needed_bytes: int
    available_bytes: int
    total_bytes: int
    message: str


def memory_fit(needed: int, weights: int, available: int, total: int) -> Fit:
    """The verdict for `needed` bytes (weights, KV cache, state, runtime) on a machine with `total` RAM,
    `available` free.

    Memory-mapped weights larger than RAM still "load", but every token then rereads them from disk:
    far too slow to use, so that counts as not fitting."""
    need, have, free = human_bytes(needed), human_bytes(total), human_bytes(available)
    if needed > total:
        part = "its weights alone need" if weights > total else "weights, KV cache and runtime need"
        message = (
            f"does not fit: {part} {need}, this machine has {have} of RAM. Use a smaller "
            "quantization or --ctx-size, or run it across machines (docs/scaling.md)."
        )
        return Fit("too big", needed, available, total, message)
    if needed > available:
        message = (
            f"tight: needs {need}, {free} of {have} is free now; close other programs or lower --ctx-size."
        )
        return Fit("tight", needed, available, total, message)
    return Fit("fits", needed, available, total, f"fits: needs {need}, {free} of {have} is free.")


def kv_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, cache_types: tuple[str, str] = F16_KV
) -> int:
    """Keys and values of one token across all layers (as the engine's pool stores them)."""
    return KVLayout(n_layers, n_kv_heads, head_dim, cache_types).bytes_per_token


def summarize(gf: Any) -> ModelInfo:
    """A ModelInfo for an open GGUFFile."""
    md: Mapping[str, Any] = gf.metadata
    arch = str(md.get("general.architecture", "unknown"))

    def arch_int(key: str) -> int | None:
        value = md.get(f"{arch}.{key}")
        return _as_int(value)

    n_heads = arch_int("attention.head_count")
    dim = arch_int("embedding_length")
    head_dim = arch_int("attention.key_length")
    if head_dim is None and dim and n_heads:
        head_dim = dim // n_heads
    n_kv_heads = arch_int("attention.head_count_kv") or n_heads
    if isinstance(md.get(f"{arch}.attention.head_count_kv"), (list, tuple)):  # per layer (gemma4)
        n_kv_heads, head_dim = _widest_kv_row(md, arch, head_dim)
    vocab = arch_int("vocab_size")
    if vocab is None and md.get("tokenizer.ggml.tokens") is not None:
        vocab = len(md["tokenizer.ggml.tokens"])
    histogram = tensor_histogram(gf.tensors.values())
    parameters = sum(t.parameters for t in histogram)
    extra = _family_features(md, arch) | _active_parameters(md, arch, gf.tensors.values(), parameters)
    extra |= {
        k.removeprefix("general."): printable(md[k]) if isinstance(md[k], str) else md[k]
        for k in ("general.basename", "general.size_label", "general.license", "general.organization")
        if isinstance(md.get(k), (str, int, float))
    }
    if len(getattr(gf, "paths", ())) > 1:  # a split model: `path` is its first file
        extra["split files"] = len(gf.paths)
    template = md.get("tokenizer.chat_template")
    return ModelInfo(
        path=str(gf.path),
        file_size=int(gf.size),  # all files of a split model
        name=printable(md.get("general.name") or gf.path.stem),
        architecture=printable(arch),
        parameters=parameters,
        quant=file_quant(md, gf.tensors.values()),
        tensor_types=histogram,
        context_length=arch_int("context_length"),
        embedding_length=dim,
        n_layers=arch_int("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tokenizer=printable(md["tokenizer.ggml.model"]) if md.get("tokenizer.ggml.model") else None,
        chat_template=printable(template, multiline=True) if template else None,
        extra=extra,
        **recurrent_state(md, arch, arch_int("block_count") or 0),
        **_ffn_widths(md, arch),
    )


def _ffn_widths(md: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ModelInfo's ffn_length (the widest layer's, where it is given per layer), experts_used and
    expert_ffn (Mixtral's experts are feed_forward_length wide)."""
    ffn = md.get(f"{arch}.feed_forward_length")
    widths = [_as_int(v) for v in ffn] if isinstance(ffn, (list, tuple)) else [_as_int(ffn)]
    width = max((w for w in widths if w is not None), default=None)
    used = _as_int(md.get(f"{arch}.expert_used_count")) or 0
    expert = _as_int(md.get(f"{arch}.expert_feed_forward_length")) or width
    return {"ffn_length": width, "experts_used": used, "expert_ffn": expert if used else None}


def recurrent_state(md: Mapping[str, Any], arch: str, n_layers: int) -> dict[str, int]:
    """ModelInfo's recurrent_layers and state_bytes_per_sequence from a Gated DeltaNet hybrid's ssm.*
    keys (as models/qwen35.py reads them); {} for other models."""
    keys = ("conv_kernel", "state_size", "group_count", "time_step_rank")
    conv, d, n_k, n_v = (_as_int(md.get(f"{arch}.ssm.{k}")) or 0 for k in keys)
    if not (conv and d and n_k and n_v and n_layers) or f"{arch}.full_attention_interval" not in md:
        return {}
    n_layers -= _as_int(md.get(f"{arch}.nextn_predict_layers")) or 0
    interval = _as_int(md.get(f"{arch}.full_attention_interval")) or 4
    flags = md.get(f"{arch}.attention.recurrent_layers")
    n_rec = sum(bool(f) for f in list(flags)[:n_layers]) if flags is not None else \
        sum((il + 1) % interval != 0 for il in range(n_layers))  # fmt: skip
    per_layer = (conv - 1) * (2 * n_k + n_v) * d + n_v * d * d
    return {"recurrent_layers": n_rec, "state_bytes_per_sequence": 4 * n_rec * per_layer}


# <arch>.KEY -> the name `info` shows it under: what sets the newer families apart (issue 15).
FAMILY_KEYS = {
    "attention.sliding_window": "sliding window",
    "rope.scaling.type": "rope scaling",
    "rope.scaling.factor": "rope scaling factor",
    "rope.scaling.original_context_length": "rope original context",
    "attn_logit_softcapping": "attention soft-cap",
    "final_logit_softcapping": "final logit soft-cap",
    "expert_count": "experts",
    "expert_used_count": "experts per token",
}


def _family_features(md: Mapping[str, Any], arch: str) -> dict[str, Any]:
    out = {
        name: md[f"{arch}.{key}"]
        for key, name in FAMILY_KEYS.items()
        if isinstance(md.get(f"{arch}.{key}"), (str, int, float))
    }
    return {k: printable(v) if isinstance(v, str) else v for k, v in out.items()}


def _active_parameters(md: Mapping[str, Any], arch: str, tensors: Any, parameters: int) -> dict[str, str]:
    """A mixture-of-experts file's parameters one token runs: all but the unrouted experts' share."""
    experts, used = _as_int(md.get(f"{arch}.expert_count")), _as_int(md.get(f"{arch}.expert_used_count"))
    if not experts or not used:
        return {}
    routed = sum(_numel(t.shape) for t in tensors if "_exps." in t.name)
    active = parameters - routed + routed * min(used, experts) // experts
    return {"active parameters": f"{format_params(active)} ({active:,}) per token"}


def tensor_histogram(tensors: Any) -> list[TensorTypeCount]:
    """Count, parameters and bytes per ggml type, the largest share of the file first."""
    counts: dict[str, list[int]] = {}
    for t in tensors:
        row = counts.setdefault(type_name(t.ggml_type), [0, 0, 0])
        row[0] += 1
        row[1] += _numel(t.shape)
        row[2] += int(t.nbytes)
    rows = [TensorTypeCount(name, c, p, b) for name, (c, p, b) in counts.items()]
    return sorted(rows, key=lambda r: (-r.bytes, r.type))


def file_quant(metadata: Mapping[str, Any], tensors: Any) -> str:
    """The file's quantization label, e.g. "Q4_K_M": general.file_type when set, else the ggml type
    holding the most matrix parameters."""
    ftype = _as_int(metadata.get("general.file_type"))
    if ftype is not None:
        try:
            from gguf import LlamaFileType

            return LlamaFileType(ftype).name.removeprefix("MOSTLY_")
        except (ImportError, ValueError):
            pass
    weight: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2:
            name = type_name(t.ggml_type)
            weight[name] = weight.get(name, 0) + _numel(t.shape)
    return max(weight, key=lambda k: weight[k]) if weight else ""


def type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type{ggml_type}"


def format_params(n: int) -> str:
    """135M, 1.7B, 91.3K: the way model cards write parameter counts."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            text = f"{value:.1f}" if value < 100 else f"{value:.0f}"
            return text.removesuffix(".0") + suffix
    return str(n)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    exponent = min(4, (int(n).bit_length() - 1) // 10)
    return f"{n / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def short_template(text: str, max_lines: int = 12, max_chars: int = 800) -> tuple[str, bool]:
    """The template cut to a readable size; True when something was left out."""
    lines = text.splitlines()
    cut = "\n".join(lines[:max_lines])
    if len(cut) > max_chars:
        cut = cut[:max_chars]
    return cut, cut != text


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _widest_kv_row(md: Mapping[str, Any], arch: str, head_dim: int | None) -> tuple[int | None, int | None]:
    """(KV heads, head dim) of the layer with the widest KV rows, which the engine's KV pool gives
    every layer, where head_count_kv has one value per layer (sliding layers' heads key_length_swa)."""
    kv, pattern = md[f"{arch}.attention.head_count_kv"], md.get(f"{arch}.attention.sliding_window_pattern")
    swa_dim = _as_int(md.get(f"{arch}.attention.key_length_swa")) or head_dim
    rows = []
    for il, heads in enumerate(kv):
        sliding = isinstance(pattern, (list, tuple)) and il < len(pattern) and bool(pattern[il])
        dim = swa_dim if sliding else head_dim
        if _as_int(heads) is None or dim is None:
            return None, head_dim
        rows.append((int(heads), int(dim)))
    return max(rows, key=lambda r: r[0] * r[1], default=(None, head_dim))


def _as_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
