"""Tiny random-weight mixture-of-experts GGUFs as llama.cpp names their tensors and keys: qwen3moe
(8 experts, top-2, renormalised; Q8_0 and Q4_0 experts), qwen2moe (a sigmoid-gated shared expert,
weights not renormalised) and a Mixtral-style llama file; the vocabulary of tiny_model.py.

Routers are float32 as converters keep them, scaled so each token's top-2 hold about half the
probability (renormalising then matters), and the experts are large enough to steer the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_arch import DIM, HEADS, KV_HEADS, OUT_SCALE
from tiny_model import RandomTensors, vocabulary, write_vocabulary

# variant -> (general.architecture, quant, what the file exercises)
MOE_VARIANTS = {
    "qwen3moe": ("qwen3moe", "Q8_0", "8 experts, top-2 renormalised, q/k norms, head_dim 32"),
    "qwen3moe_q4": ("qwen3moe", "Q4_0", "qwen3moe with Q4_0 experts"),
    "qwen2moe": ("qwen2moe", "F32", "8 experts, top-2 as routed, sigmoid-gated shared expert, q/k/v biases"),
    "mixtral": ("llama", "F32", "Mixtral-style llama experts (feed_forward_length wide), top-2 renormalised"),
}
N_EXPERTS, N_USED, EXPERT_FFN, SHARED_FFN = 8, 2, 64, 96
ROUTER_SCALE, EXPERT_SCALE = 1.5, 0.5
# Output projection scale: median top-1/top-2 margins of several logits (qwen2moe's shared expert
# flattens its distribution: a larger one)
OUT_SCALES = {"qwen2moe": 24.0}


@dataclass(frozen=True)
class Shape:
    """The file's sizes: the tiny fixtures' by default, bigger for a benchmark."""

    dim: int = DIM
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = DIM // HEADS
    expert_ffn: int = EXPERT_FFN
    n_layers: int = 4


def _moe_metadata(w, arch: str, s: Shape) -> None:
    tokens, types, merges = vocabulary()
    w.add_block_count(s.n_layers)
    w.add_context_length(512)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.expert_ffn if arch == "llama" else 2 * s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.expert_count", N_EXPERTS)
    w.add_uint32(f"{arch}.expert_used_count", N_USED)
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide
        w.add_uint32(f"{arch}.expert_feed_forward_length", s.expert_ffn)
    if arch == "qwen2moe":
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", SHARED_FFN)
    if s.head_dim != s.dim // s.heads:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    write_vocabulary(w, (tokens, types, merges))


def write_moe_variant(path: Path, variant: str, quant: str | None = None, seed: int = 11,
                      shape: Shape | None = None) -> Path:  # fmt: skip
    """A random-weight file of one of MOE_VARIANTS (shape: bigger sizes for a benchmark)."""
    import gguf

    arch, default_quant, _ = MOE_VARIANTS[variant]
    s = shape or (Shape(head_dim=32) if arch == "qwen3moe" else Shape())
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _moe_metadata(w, arch, s)
    t = RandomTensors(w, rng, quant or default_quant)
    n_vocab = len(vocabulary()[0])
    t.matrix("token_embd.weight", n_vocab, s.dim)
    t.matrix("output.weight", n_vocab, s.dim, OUT_SCALES.get(variant, OUT_SCALE))
    t.vector("output_norm.weight", s.dim)
    for il in range(s.n_layers):
        _moe_layer(t, arch, f"blk.{il}", s)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _experts(t: RandomTensors, name: str, rows: int, cols: int) -> None:
    """A (experts, rows, cols) tensor, quantized like the matrices."""
    from gguf.quants import quantize

    data = (t.rng.standard_normal((N_EXPERTS, rows, cols)) * EXPERT_SCALE / np.sqrt(cols)).astype(np.float32)
    if t.quant == "F32":
        t.w.add_tensor(name, data)
    else:
        t.w.add_tensor(name, quantize(data, t.qtype), raw_dtype=t.qtype)


def _moe_layer(t: RandomTensors, arch: str, p: str, s: Shape) -> None:
    nq, nkv, dim, ffn, head_dim = (
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.dim,
        s.expert_ffn,
        s.head_dim,
    )
    t.vector(f"{p}.attn_norm.weight", dim)
    t.vector(f"{p}.ffn_norm.weight", dim)
    t.matrix(f"{p}.attn_q.weight", nq, dim, 1.5)
    t.matrix(f"{p}.attn_k.weight", nkv, dim, 1.5)
    t.matrix(f"{p}.attn_v.weight", nkv, dim)
    t.matrix(f"{p}.attn_output.weight", dim, nq)
    router = t.rng.standard_normal((N_EXPERTS, dim)) * ROUTER_SCALE / np.sqrt(dim)
    t.w.add_tensor(f"{p}.ffn_gate_inp.weight", router.astype(np.float32))
    _experts(t, f"{p}.ffn_gate_exps.weight", ffn, dim)
    _experts(t, f"{p}.ffn_up_exps.weight", ffn, dim)
    _experts(t, f"{p}.ffn_down_exps.weight", dim, ffn)
    if arch == "qwen3moe":
        t.vector(f"{p}.attn_q_norm.weight", head_dim, 0.5)
        t.vector(f"{p}.attn_k_norm.weight", head_dim, 0.5)
    if arch == "qwen2moe":
        for name, n in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
            t.w.add_tensor(f"{p}.{name}.bias", (0.3 * t.rng.standard_normal(n)).astype(np.float32))
        t.w.add_tensor(
            f"{p}.ffn_gate_inp_shexp.weight", (t.rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32)
        )
        t.matrix(f"{p}.ffn_gate_shexp.weight", SHARED_FFN, dim)
        t.matrix(f"{p}.ffn_up_shexp.weight", SHARED_FFN, dim)
        t.matrix(f"{p}.ffn_down_shexp.weight", dim, SHARED_FFN)


# The benchmark's file (README, Benchmarks): python tests/support/tiny_moe.py OUT.gguf Q4_0
BENCH_SHAPE = Shape(dim=1024, heads=16, kv_heads=4, head_dim=64, expert_ffn=768, n_layers=8)

if __name__ == "__main__":
    import sys

    write_moe_variant(Path(sys.argv[1]), "qwen3moe", sys.argv[2], shape=BENCH_SHAPE)
