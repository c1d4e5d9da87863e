"""Random-weight GGUFs of the hybrid linear-attention architectures, as llama.cpp names their keys and
tensors: qwen35 (Qwen3.5 dense), qwen35moe (Qwen3.5 with routed and shared experts) and qwen3next.

Three of every four layers are Gated DeltaNet (a short causal convolution over q/k/v, L2-normalised
q/k, a gated delta-rule state per value head, a per-head RMSNorm gated by silu(z)); the fourth is
full attention whose q projection also carries a per-head sigmoid output gate, with q/k norms and a
partial NEOX rotation (qwen35's interleaved M-RoPE sections, all text positions equal). The tiny
shape keeps the ratios of the real models (more value heads than key heads, head dim > dim / heads,
a quarter of the head rotated); BENCH_SHAPE is Qwen3.5-0.8B's, with tiny_model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_model import RandomTensors, vocabulary, write_vocabulary

# variant -> (general.architecture, quant, what the file exercises)
HYBRID_VARIANTS = {
    "qwen35": ("qwen35", "Q8_0", "3:1 Gated DeltaNet / gated full attention, 4 value heads over 2 key heads"),
    "qwen35_f32": ("qwen35", "F32", "qwen35 with float32 matrices"),
    "qwen35moe": ("qwen35moe", "Q8_0", "qwen35 with 8 experts top-2 and a sigmoid-gated shared expert"),
    "qwen3next": ("qwen3next", "Q8_0", "fused ssm_ba, key heads repeated interleaved, plain NEOX RoPE"),
}
OUT_SCALE = 16.0
QKV_SCALE, BA_SCALE = 1.5, 2.0  # input projections of the Gated DeltaNet
N_EXPERTS, N_USED = 8, 2


@dataclass(frozen=True)
class Shape:
    dim: int = 64
    ffn: int = 128
    n_layers: int = 4
    heads: int = 4  # full attention
    kv_heads: int = 2
    head_dim: int = 32
    rope_dim: int = 16  # a quarter of head_dim, as the real models
    sections: tuple[int, int, int, int] = (3, 3, 2, 0)
    k_heads: int = 2  # Gated DeltaNet
    v_heads: int = 4
    ssm_head_dim: int = 32
    conv: int = 4
    interval: int = 4  # every 4th layer is full attention
    expert_ffn: int = 64
    shared_ffn: int = 96
    ctx: int = 512


TINY = Shape()
# Qwen3.5-0.8B's layers (the vocabulary stays tiny_model's: the speed is the layers')
BENCH_SHAPE = Shape(dim=1024, ffn=3584, n_layers=24, heads=8, kv_heads=2, head_dim=256, rope_dim=64,
                    sections=(11, 11, 10, 0), k_heads=16, v_heads=16, ssm_head_dim=128, ctx=4096)  # fmt: skip
# a small Qwen3.5-MoE (35B-A3B's ratios at 1/2 width, 8 layers)
BENCH_MOE_SHAPE = Shape(dim=1024, ffn=512, n_layers=8, heads=8, kv_heads=2, head_dim=256, rope_dim=64,
                        sections=(11, 11, 10, 0), k_heads=8, v_heads=16, ssm_head_dim=128, expert_ffn=256,
                        shared_ffn=256, ctx=4096)  # fmt: skip


def is_recurrent(s: Shape, il: int) -> bool:
    return (il + 1) % s.interval != 0


def _metadata(w, arch: str, s: Shape) -> None:
    w.add_block_count(s.n_layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_dimension_count(s.rope_dim)
    if arch != "qwen3next":
        w.add_array(f"{arch}.rope.dimension_sections", list(s.sections))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.ssm.conv_kernel", s.conv)
    w.add_uint32(f"{arch}.ssm.inner_size", s.ssm_head_dim * s.v_heads)
    w.add_uint32(f"{arch}.ssm.state_size", s.ssm_head_dim)
    w.add_uint32(f"{arch}.ssm.time_step_rank", s.v_heads)
    w.add_uint32(f"{arch}.ssm.group_count", s.k_heads)
    w.add_uint32(f"{arch}.full_attention_interval", s.interval)
    if arch != "qwen35":
        w.add_uint32(f"{arch}.expert_count", N_EXPERTS)
        w.add_uint32(f"{arch}.expert_used_count", N_USED)
        w.add_uint32(f"{arch}.expert_feed_forward_length", s.expert_ffn)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s.shared_ffn)
    write_vocabulary(w, vocabulary())


def write_hybrid(
    path: Path, variant: str, quant: str | None = None, seed: int = 5, shape: Shape = TINY
) -> Path:
    """A random-weight file of one of HYBRID_VARIANTS (shape: bigger sizes for a benchmark)."""
    import gguf

    arch, default_quant, _ = HYBRID_VARIANTS[variant]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, shape)
    t = RandomTensors(w, rng, quant or default_quant)
    n_vocab = len(vocabulary()[0])
    t.matrix("token_embd.weight", n_vocab, shape.dim)
    t.matrix("output.weight", n_vocab, shape.dim, OUT_SCALE)
    t.vector("output_norm.weight", shape.dim)
    for il in range(shape.n_layers):
        p = f"blk.{il}"
        t.vector(f"{p}.attn_norm.weight", shape.dim)
        t.vector(f"{p}.post_attention_norm.weight", shape.dim)
        if is_recurrent(shape, il):
            _delta_net(t, arch, p, shape)
        else:
            _attention(t, p, shape)
        if arch == "qwen35":
            for name, rows, cols in (("ffn_gate", shape.ffn, shape.dim), ("ffn_up", shape.ffn, shape.dim),
                                     ("ffn_down", shape.dim, shape.ffn)):  # fmt: skip
                t.matrix(f"{p}.{name}.weight", rows, cols)
        else:
            _experts(t, p, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _f32(t: RandomTensors, name: str, data: np.ndarray) -> None:
    t.w.add_tensor(name, np.ascontiguousarray(data, np.float32))


def _attention(t: RandomTensors, p: str, s: Shape) -> None:
    nq, nkv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    t.matrix(f"{p}.attn_q.weight", 2 * nq, s.dim, 1.5)  # per head: head_dim of q, then head_dim of gate
    t.matrix(f"{p}.attn_k.weight", nkv, s.dim, 1.5)
    t.matrix(f"{p}.attn_v.weight", nkv, s.dim)
    t.matrix(f"{p}.attn_output.weight", s.dim, nq)
    t.vector(f"{p}.attn_q_norm.weight", s.head_dim, 0.5)
    t.vector(f"{p}.attn_k_norm.weight", s.head_dim, 0.5)


def _delta_net(t: RandomTensors, arch: str, p: str, s: Shape) -> None:
    key, value = s.k_heads * s.ssm_head_dim, s.v_heads * s.ssm_head_dim
    conv_dim = 2 * key + value
    t.matrix(f"{p}.attn_qkv.weight", conv_dim, s.dim, QKV_SCALE)
    t.matrix(f"{p}.attn_gate.weight", value, s.dim, 1.5)
    if arch == "qwen3next":  # per key head: its value heads' beta, then their alpha
        t.matrix(f"{p}.ssm_ba.weight", 2 * s.v_heads, s.dim, BA_SCALE)
    else:
        t.matrix(f"{p}.ssm_beta.weight", s.v_heads, s.dim, BA_SCALE)
        t.matrix(f"{p}.ssm_alpha.weight", s.v_heads, s.dim, BA_SCALE)
    _f32(t, f"{p}.ssm_conv1d.weight", t.rng.standard_normal((conv_dim, s.conv)) * 0.5)
    _f32(t, f"{p}.ssm_dt.bias", t.rng.uniform(-1.0, 1.0, s.v_heads))
    _f32(t, f"{p}.ssm_a", -np.exp(t.rng.uniform(-1.5, 1.0, s.v_heads)))  # -exp(A_log): decay speeds
    t.vector(f"{p}.ssm_norm.weight", s.ssm_head_dim)
    t.matrix(f"{p}.ssm_out.weight", s.dim, value)


def _experts(t: RandomTensors, p: str, s: Shape) -> None:
    from tiny_moe import _experts as experts

    router = t.rng.standard_normal((N_EXPERTS, s.dim)) * 1.5 / np.sqrt(s.dim)
    _f32(t, f"{p}.ffn_gate_inp.weight", router)
    experts(t, f"{p}.ffn_gate_exps.weight", s.expert_ffn, s.dim)
    experts(t, f"{p}.ffn_up_exps.weight", s.expert_ffn, s.dim)
    experts(t, f"{p}.ffn_down_exps.weight", s.dim, s.expert_ffn)
    _f32(t, f"{p}.ffn_gate_inp_shexp.weight", t.rng.standard_normal(s.dim) / np.sqrt(s.dim))
    t.matrix(f"{p}.ffn_gate_shexp.weight", s.shared_ffn, s.dim)
    t.matrix(f"{p}.ffn_up_shexp.weight", s.shared_ffn, s.dim)
    t.matrix(f"{p}.ffn_down_shexp.weight", s.dim, s.shared_ffn)


# The benchmark's files (not in the repository):
#   python tests/support/tiny_hybrid.py OUT.gguf Q8_0 [qwen35|qwen35moe]
if __name__ == "__main__":
    import sys

    variant = sys.argv[3] if len(sys.argv) > 3 else "qwen35"
    write_hybrid(
        Path(sys.argv[1]), variant, sys.argv[2], shape=BENCH_MOE_SHAPE if "moe" in variant else BENCH_SHAPE
    )
