"""Tiny random-weight GGUFs of every supported architecture, each exercising its LayerSpec fields.

llama with a sliding window and linear RoPE scaling, qwen2 (q/k/v biases, NEOX RoPE) and gemma3 (q/k
norms, post-norms, GeGLU, local/global RoPE bases, a 16-token window on five of six layers), with the
byte-level BPE vocabulary of tiny_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_model import RandomTensors, vocabulary, write_vocabulary

DIM, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
ARCHS = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class Shape:
    """The file's sizes: the tiny fixtures' by default, bigger for a benchmark
    (fixtures/make_bench_arch_files.py). head_dim 0: the variant's own; vocab None: tiny_model's."""

    dim: int = DIM
    ffn: int = FFN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = 0
    ctx: int = 512
    vocab: tuple | None = None

    def tokens(self) -> tuple[list[str], list[int], list[str]]:
        return self.vocab or vocabulary()


TINY = Shape()


def _metadata(w, arch: str, n_layers: int, window: int, rope_scale: float, s: Shape = TINY) -> None:
    import gguf

    tokens, types, merges = s.tokens()
    w.add_block_count(n_layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(10000.0 if arch not in ("gemma3", "gemma4") else 1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if window:
        w.add_sliding_window(window)
    if arch == "llama" and rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scale)
    if arch == "gemma3":
        w.add_key_length(s.head_dim or HEAD_DIM)
        w.add_value_length(s.head_dim or HEAD_DIM)
    write_vocabulary(w, (tokens, types, merges))


def write_arch_model(path: Path, arch: str, quant: str = "Q8_0", n_layers: int = 6, window: int = 16,
                     seed: int = 1, rope_scale: float = 2.0, shape: Shape = TINY) -> Path:  # fmt: skip
    """A random `arch` model; `window` applies to every llama layer and to gemma3's local layers,
    `rope_scale` is llama's linear RoPE scaling factor."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, n_layers, window, rope_scale, shape)
    t = RandomTensors(w, rng, quant)
    matrix, vector = t.matrix, t.vector

    dim, ffn, head_dim = shape.dim, shape.ffn, shape.head_dim or HEAD_DIM
    matrix("token_embd.weight", len(shape.tokens()[0]), dim)
    vector("output_norm.weight", dim)
    nq, nkv = shape.heads * head_dim, shape.kv_heads * head_dim
    for il in range(n_layers):
        p = f"blk.{il}"
        for name, n in (("attn_norm", dim), ("ffn_norm", dim)):
            vector(f"{p}.{name}.weight", n)
        for name, rows, cols in (("attn_q", nq, dim), ("attn_k", nkv, dim), ("attn_v", nkv, dim),
                                 ("attn_output", dim, nq), ("ffn_gate", ffn, dim), ("ffn_up", ffn, dim),
                                 ("ffn_down", dim, ffn)):  # fmt: skip
            matrix(f"{p}.{name}.weight", rows, cols)
        if arch == "qwen2":
            for name, n in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
                w.add_tensor(f"{p}.{name}.bias", (0.3 * rng.standard_normal(n)).astype(np.float32))
        if arch == "gemma3":
            for name, n in (("attn_q_norm", head_dim), ("attn_k_norm", head_dim),
                            ("post_attention_norm", dim), ("post_ffw_norm", dim)):  # fmt: skip
                vector(f"{p}.{name}.weight", n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the families of issue 15, written as llama.cpp names their tensors and keys ------------------------
# variant -> (general.architecture, quant, what the file exercises)
VARIANTS = {
    "llama3": ("llama", "Q8_0", "rope_freqs.weight per-pair frequency divisors"),
    "qwen3": ("qwen3", "F32", "q/k RMS norms, NEOX RoPE, head_dim 32 != dim / heads"),
    "gemma2": ("gemma2", "F32", "attention and final soft-caps, even layers windowed, post-norms, GeGLU"),
    "phi3": ("phi3", "Q8_0", "fused attn_qkv and gate+up ffn_up, LongRoPE short factors, attn_factor"),
    "llama_yarn": ("llama", "F32", "YaRN RoPE scaling (factor 4 over a 16-token original context)"),
    # phi3's weights with a 64-token original context: the tests' 128 (llama.cpp's 512) take the long factors
    "phi3_long": ("phi3", "Q8_0", "LongRoPE long factors (context over the original one)"),
    "smollm3": ("smollm3", "F32", "no RoPE on every fourth layer (NoPE)"),
    "mistral3": ("mistral3", "F32", "attention temperature past a 16-token original context, YaRN log mul"),
    "gemma4": ("gemma4", "F32", "v from k and v norm on full layers, partial RoPE, layer scalars, 5:1 SWA"),
}
V_HEAD_DIM = {"qwen3": 32, "gemma4": 32}
V_LAYERS = {"gemma4": 6}  # layers where the variant's default differs from write_variant's
GEMMA4_FULL_EVERY = 3  # every third layer full (5:1 in the real models): two of six here
SOFTCAPS = {"attn": 1.5, "final": 30.0}  # attention's small enough that dropping it changes the answer
# Output projection scales: peaky next-token distributions (median top-1/top-2 margin of several
# logits); gemma2's output is its (tied) embedding, under a final soft-cap of 30 as in the real models.
OUT_SCALE, GEMMA2_EMBD_SCALE = 16.0, 6.0
MISTRAL3_TEMP = 0.5  # Ministral 3's is 0.1 over 16k tokens; larger, so dropping it changes the answer


def _variant_metadata(
    w, variant: str, arch: str, n_layers: int, head_dim: int, s: Shape, window: int
) -> None:
    import gguf

    _metadata(w, arch, n_layers, window if arch in ("gemma2", "gemma4") else 0, 1.0, s)
    if head_dim != s.dim // s.heads or arch == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if variant == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", SOFTCAPS["attn"])
        w.add_float32(f"{arch}.final_logit_softcapping", SOFTCAPS["final"])
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", 1.19)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", 64 if variant == "phi3_long" else s.ctx)
    if variant in ("llama_yarn", "mistral3"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", 16)
    if arch == "gemma4":
        _gemma4_metadata(w, arch, n_layers, head_dim)
    if variant == "mistral3":
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 1.0)
        w.add_float32(f"{arch}.attention.temperature_scale", MISTRAL3_TEMP)


def _gemma4_swa(il: int) -> bool:
    return (il + 1) % GEMMA4_FULL_EVERY != 0


def _gemma4_metadata(w, arch: str, n_layers: int, head_dim: int) -> None:
    for key in ("key_length_swa", "value_length_swa"):
        w.add_uint32(f"{arch}.attention.{key}", head_dim)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [_gemma4_swa(il) for il in range(n_layers)])
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count_swa", head_dim)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", 0)
    w.add_float32(f"{arch}.final_logit_softcapping", SOFTCAPS["final"])


def _gemma4_tensors(w, rng, head_dim: int, n_layers: int) -> None:
    """Proportional RoPE on the full layers (a quarter of the pairs turn) and each layer's scalar."""
    quarter = head_dim // 8
    factors = [1.0] * quarter + [1e30] * (head_dim // 2 - quarter)
    w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    for il in range(n_layers):
        w.add_tensor(f"blk.{il}.layer_output_scale.weight", rng.uniform(0.5, 1.5, 1).astype(np.float32))


def write_variant(
    path: Path, variant: str, quant: str | None = None, n_layers: int | None = None, seed: int = 7,
    extra: dict[str, np.ndarray] | None = None, shape: Shape = TINY, window: int = 16,
) -> Path:  # fmt: skip
    """A random-weight file of one of VARIANTS, peaky enough that most next tokens are clear; `extra`
    adds tensors no model reads; `window`: gemma2's on its even layers."""
    import gguf

    arch, default_quant, _ = VARIANTS[variant]
    quant = quant or default_quant
    n_layers = n_layers or V_LAYERS.get(variant, 4)
    head_dim = shape.head_dim or V_HEAD_DIM.get(variant, HEAD_DIM)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _variant_metadata(w, variant, arch, n_layers, head_dim, shape, window)
    t = RandomTensors(w, rng, quant)
    matrix, vector = t.matrix, t.vector

    n_vocab, dim = len(shape.tokens()[0]), shape.dim
    tied = arch in ("gemma2", "gemma4")
    matrix("token_embd.weight", n_vocab, dim, GEMMA2_EMBD_SCALE if tied else 1.0)
    if not tied:
        matrix("output.weight", n_vocab, dim, OUT_SCALE)
    vector("output_norm.weight", dim)
    if variant == "llama3":
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 6.0, head_dim // 2).astype(np.float32))
    if arch == "phi3":
        for kind in ("short", "long"):
            factors = rng.uniform(1.0, 6.0, head_dim // 2).astype(np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "gemma4":
        _gemma4_tensors(w, rng, head_dim, n_layers)
    for il in range(n_layers):
        _variant_layer(arch, f"blk.{il}", head_dim, shape, matrix, vector)
        if arch == "gemma4" and _gemma4_swa(il):  # full layers have no attn_v: v is k's projection
            matrix(f"blk.{il}.attn_v.weight", shape.kv_heads * head_dim, dim)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _variant_layer(arch: str, p: str, head_dim: int, s: Shape, matrix, vector) -> None:
    nq, nkv, dim, ffn = s.heads * head_dim, s.kv_heads * head_dim, s.dim, s.ffn
    vector(f"{p}.attn_norm.weight", dim)
    vector(f"{p}.ffn_norm.weight", dim)
    if arch == "phi3":
        matrix(f"{p}.attn_qkv.weight", nq + 2 * nkv, dim, 1.5)
        matrix(f"{p}.ffn_up.weight", 2 * ffn, dim)
    else:
        matrix(f"{p}.attn_q.weight", nq, dim, 1.5)
        matrix(f"{p}.attn_k.weight", nkv, dim, 1.5)
        if arch != "gemma4":  # (written by write_variant on its sliding layers only)
            matrix(f"{p}.attn_v.weight", nkv, dim)
        matrix(f"{p}.ffn_gate.weight", ffn, dim)
        matrix(f"{p}.ffn_up.weight", ffn, dim)
    matrix(f"{p}.attn_output.weight", dim, nq)
    matrix(f"{p}.ffn_down.weight", dim, ffn)
    if arch in ("qwen3", "gemma4"):
        vector(f"{p}.attn_q_norm.weight", head_dim, 0.5)
        vector(f"{p}.attn_k_norm.weight", head_dim, 0.5)
    if arch in ("gemma2", "gemma4"):
        vector(f"{p}.post_attention_norm.weight", dim)
        vector(f"{p}.post_ffw_norm.weight", dim)
