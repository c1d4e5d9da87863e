"""Random-weight gpt-oss GGUFs as llama.cpp names their tensors and keys (LLM_ARCH_OPENAI_MOE), with
MXFP4 experts and Q8_0 elsewhere (llama-quantize's MXFP4_MOE): attention sinks, q/k/v/output biases,
router and expert biases, even layers on a sliding window, YaRN, top-4 of 8 experts; the vocabulary of
tiny_model.py.

Scales make each feature matter: gate/up outputs reach past the clamped SwiGLU's limit of 7, the sinks
sit among the attention scores, and the output projection gives peaky next-token distributions.
`python tests/support/tiny_gptoss.py OUT.gguf` writes the benchmark's file: gpt-oss-20b's layer shape
(dim 2880, 64 heads of 64, 8 KV heads, experts 2880 wide, top-4) with 16 experts and 4 layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_model import RandomTensors, vocabulary, write_vocabulary

ARCH = "gpt-oss"
ROUTER_SCALE, OUT_SCALE = 1.5, 16.0


@dataclass(frozen=True)
class Shape:
    dim: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 8
    used: int = 4
    expert_ffn: int = 128
    n_layers: int = 4
    window: int = 16
    ctx: int = 2048
    yarn_factor: float = 32.0
    yarn_orig_ctx: int = 64  # 2048 / 32: positions of a 64-token test already fall in YaRN's ramp
    random_experts: bool = False  # random MXFP4 bytes (fast, for big files) instead of quantized normals
    gate_up_scale: float = 2.5  # std of the experts' gate/up outputs: ~0.5% pass the clamp's limit of 7
    router_bias: float = 0.5  # std of the router's logit bias (its logits' is 1.5)
    expert_bias: float = 0.5  # std of the experts' gate/up biases (down's: a fifth of it)


TINY = Shape()
BENCH = Shape(dim=2880, heads=64, kv_heads=8, head_dim=64, experts=16, used=4, expert_ffn=2880,
              n_layers=4, window=128, ctx=131072, yarn_orig_ctx=4096, random_experts=True)  # fmt: skip


def _metadata(w, s: Shape) -> None:
    import gguf

    w.add_block_count(s.n_layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(s.window)
    w.add_uint32(f"{ARCH}.expert_count", s.experts)
    w.add_uint32(f"{ARCH}.expert_used_count", s.used)
    w.add_uint32(f"{ARCH}.expert_feed_forward_length", s.expert_ffn)
    write_vocabulary(w, vocabulary())


def _random_mxfp4(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random MXFP4 bytes whose values spread like normals of std `scale` (codes uniform, exponent
    set so the largest code, 6 * 2**(e - 127), is about 2.5 std)."""
    *lead, cols = shape
    blocks = np.empty((int(np.prod(lead)), cols // 32, 17), np.uint8)
    blocks[..., 0] = np.uint8(127 + int(np.floor(np.log2(2.5 * scale / 6))))
    blocks[..., 1:] = rng.integers(0, 256, blocks[..., 1:].shape, dtype=np.uint8)
    return blocks.reshape(*lead, cols // 32 * 17)


def _experts(t: RandomTensors, s: Shape, name: str, rows: int, cols: int, scale: float) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    mx = GGMLQuantizationType.MXFP4
    if s.random_experts:
        t.w.add_tensor(
            name, _random_mxfp4(t.rng, (s.experts, rows, cols), scale / np.sqrt(cols)), raw_dtype=mx
        )
        return
    data = (t.rng.standard_normal((s.experts, rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
    if t.quant == "F32":  # (an all-float file: no activation rounding anywhere in llama.cpp)
        t.w.add_tensor(name, data)
        return
    t.w.add_tensor(name, quantize(data, mx), raw_dtype=mx)


def _bias(t: RandomTensors, name: str, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> None:
    t.w.add_tensor(name, (mean + scale * t.rng.standard_normal(shape)).astype(np.float32))


def _layer(t: RandomTensors, s: Shape, p: str) -> None:
    nq, nkv, dim, f, E = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.dim, s.expert_ffn, s.experts
    t.vector(f"{p}.attn_norm.weight", dim)
    t.vector(f"{p}.post_attention_norm.weight", dim)
    for name, rows, scale in (("attn_q", nq, 1.5), ("attn_k", nkv, 1.5), ("attn_v", nkv, 0.5)):
        t.matrix(f"{p}.{name}.weight", rows, dim, scale)
        _bias(t, f"{p}.{name}.bias", (rows,), 0.3)
    t.matrix(f"{p}.attn_output.weight", dim, nq)
    _bias(t, f"{p}.attn_output.bias", (dim,), 0.1)
    _bias(t, f"{p}.attn_sinks.weight", (s.heads,), 1.0, mean=1.0)
    t.w.add_tensor(f"{p}.ffn_gate_inp.weight", (t.rng.standard_normal((E, dim)) * ROUTER_SCALE / np.sqrt(dim))
                   .astype(np.float32))  # fmt: skip
    _bias(t, f"{p}.ffn_gate_inp.bias", (E,), s.router_bias)
    _experts(t, s, f"{p}.ffn_gate_exps.weight", f, dim, s.gate_up_scale)
    _bias(t, f"{p}.ffn_gate_exps.bias", (E, f), s.expert_bias)
    _experts(t, s, f"{p}.ffn_up_exps.weight", f, dim, s.gate_up_scale)
    _bias(t, f"{p}.ffn_up_exps.bias", (E, f), s.expert_bias)
    _experts(t, s, f"{p}.ffn_down_exps.weight", dim, f, 0.25)
    _bias(t, f"{p}.ffn_down_exps.bias", (E, dim), s.expert_bias / 5)


def write_gptoss(path: Path, shape: Shape = TINY, seed: int = 3, quant: str = "Q8_0") -> Path:
    """A random gpt-oss file (experts MXFP4, other matrices `quant`, vectors and biases F32)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), ARCH)
    _metadata(w, shape)
    t = RandomTensors(w, rng, quant)
    n_vocab = len(vocabulary()[0])
    t.matrix("token_embd.weight", n_vocab, shape.dim)
    t.matrix("output.weight", n_vocab, shape.dim, OUT_SCALE)
    t.vector("output_norm.weight", shape.dim)
    for il in range(shape.n_layers):
        _layer(t, shape, f"blk.{il}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# variant -> what the file exercises (tests/fixtures/make_arch_fixtures.py makes llama.cpp's logits)
GPTOSS_VARIANTS = {
    "gptoss": "sinks, biases, clamped SwiGLU, YaRN, even layers windowed, MXFP4 top-4 of 8, Q8_0 elsewhere",
    "gptoss_f32": "all float32 (llama.cpp rounds no activations), 8% of gate/up clamped, strong biases",
}


def write_gptoss_variant(path: Path, variant: str) -> Path:
    if variant == "gptoss_f32":
        return write_gptoss(path, Shape(gate_up_scale=4.0, router_bias=1.5, expert_bias=2.5), quant="F32")
    return write_gptoss(path)


if __name__ == "__main__":
    import sys

    write_gptoss(Path(sys.argv[1]), BENCH)
