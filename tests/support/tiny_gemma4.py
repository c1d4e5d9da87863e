"""Tiny random-weight Gemma 4 GGUFs shaped as the released ones (convert_hf_to_gguf's Gemma4 class).

`gemma4_e` is an E2B/E4B-like layout at a tiny scale: sliding layers' heads `key_length_swa` (16)
wide with 4 KV heads, full layers' `key_length` (32) wide with 1 (head_count_kv one value per layer,
so the full layers' KV rows are half the sliding ones'); a full layer every fourth; the last four
layers share the KV cache of layers 2 (sliding) and 3 (full), with a double-wide FFN
(feed_forward_length per layer); per-layer inputs 8 wide; v from k on the full layers; proportional
RoPE on the full layers; a layer scalar on each; the vocabulary of tiny_model.py.

`gemma4_moe` is 26B-A4B-like: every layer runs its dense FFN (96 wide) beside 8 GeGLU experts (32 wide,
top 2) stored as one `ffn_gate_up_exps` per layer with a per-expert `ffn_down_exps.scale`; sliding and
full layers alternate; no KV sharing, no per-layer inputs. fused_experts=False writes the experts'
gate and up as separate tensors (the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_arch import GEMMA2_EMBD_SCALE, SOFTCAPS
from tiny_model import RandomTensors, vocabulary, write_vocabulary

# variant -> (general.architecture, quant, what the file exercises)
GEMMA4_VARIANTS = {
    "gemma4_e": (
        "gemma4",
        "F32",
        "E2B-like: per-layer head sizes and KV heads, KV sharing, "
        "double-wide FFN on sharing layers, per-layer inputs",
    ),  # fmt: skip
    "gemma4_moe": ("gemma4", "F32", "26B-A4B-like: dense FFN beside 8 GeGLU experts (top 2), fused gate_up"),
}


@dataclass(frozen=True)
class Shape:
    dim: int = 64
    heads: int = 4
    swa_head: int = 16
    swa_kv: int = 4
    full_head: int = 32
    full_kv: int = 1
    ffn: int = 96
    n_layers: int = 8
    full_every: int = 4
    shared_kv: int = 4
    per_layer: int = 8
    window: int = 16
    experts: int = 0  # 0: dense layers only
    experts_used: int = 2
    expert_ffn: int = 32
    fused_experts: bool = True  # one ffn_gate_up_exps (gate rows, then up rows) per layer
    expert_ffn_per_layer: bool = False  # expert_feed_forward_length as one value per layer

    def swa(self, il: int) -> bool:
        return (il + 1) % self.full_every != 0

    def head(self, il: int) -> tuple[int, int]:
        """(head dim, KV heads) of layer il."""
        return (self.swa_head, self.swa_kv) if self.swa(il) else (self.full_head, self.full_kv)

    def ffn_of(self, il: int) -> int:
        return self.ffn * (2 if il >= self.n_layers - self.shared_kv else 1)


SHAPES = {
    "gemma4_e": Shape(),
    "gemma4_moe": Shape(n_layers=4, full_every=2, shared_kv=0, per_layer=0, experts=8),
}
ROUTER_STD = 2.5  # router logits spread over a few units: top-2 picks rarely near a tie


def _metadata(w, s: Shape) -> None:
    arch = "gemma4"
    w.add_block_count(s.n_layers)
    w.add_context_length(512)
    w.add_embedding_length(s.dim)
    w.add_array(f"{arch}.feed_forward_length", [s.ffn_of(il) for il in range(s.n_layers)])
    w.add_head_count(s.heads)
    w.add_array(f"{arch}.attention.head_count_kv", [s.head(il)[1] for il in range(s.n_layers)])
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(s.window)
    w.add_key_length(s.full_head)
    w.add_value_length(s.full_head)
    w.add_uint32(f"{arch}.attention.key_length_swa", s.swa_head)
    w.add_uint32(f"{arch}.attention.value_length_swa", s.swa_head)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [s.swa(il) for il in range(s.n_layers)])
    w.add_uint32(f"{arch}.rope.dimension_count", s.full_head)
    w.add_uint32(f"{arch}.rope.dimension_count_swa", s.swa_head)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    w.add_uint32(f"{arch}.attention.shared_kv_layers", s.shared_kv)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", s.per_layer)
    w.add_float32(f"{arch}.final_logit_softcapping", SOFTCAPS["final"])
    if s.experts:
        w.add_uint32(f"{arch}.expert_count", s.experts)
        w.add_uint32(f"{arch}.expert_used_count", s.experts_used)
        if s.expert_ffn_per_layer:
            w.add_array(f"{arch}.expert_feed_forward_length", [s.expert_ffn] * s.n_layers)
        else:
            w.add_uint32(f"{arch}.expert_feed_forward_length", s.expert_ffn)
    write_vocabulary(w, vocabulary())


def write_gemma4_variant(path: Path, variant: str, quant: str | None = None, seed: int = 5,
                         shape: Shape | None = None) -> Path:  # fmt: skip
    """A random-weight file of one of GEMMA4_VARIANTS."""
    import gguf

    _, default_quant, _ = GEMMA4_VARIANTS[variant]
    s = shape or SHAPES[variant]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma4")
    _metadata(w, s)
    t = RandomTensors(w, rng, quant or default_quant)
    n_vocab, L, P = len(vocabulary()[0]), s.n_layers, s.per_layer
    t.matrix("token_embd.weight", n_vocab, s.dim, GEMMA2_EMBD_SCALE)
    t.vector("output_norm.weight", s.dim)
    if P:
        t.matrix("per_layer_token_embd.weight", n_vocab, L * P, 2.0)
        t.matrix("per_layer_model_proj.weight", L * P, s.dim, 2.0)
        t.vector("per_layer_proj_norm.weight", P)
    quarter = s.full_head // 8  # proportional RoPE: a quarter of the full layers' pairs turn
    factors = [1.0] * quarter + [1e30] * (s.full_head // 2 - quarter)
    w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    for il in range(L):
        _layer(w, t, rng, s, il)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _layer(w, t: RandomTensors, rng: np.random.Generator, s: Shape, il: int) -> None:
    p, (hd, kvh), dim, ffn = f"blk.{il}", s.head(il), s.dim, s.ffn_of(il)
    stores = il < s.n_layers - s.shared_kv
    norms = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm") + (
        ("post_norm",) if s.per_layer else ()
    )
    for name in norms:
        t.vector(f"{p}.{name}.weight", dim)
    t.matrix(f"{p}.attn_q.weight", s.heads * hd, dim, 1.5)
    t.vector(f"{p}.attn_q_norm.weight", hd, 0.5)
    if stores:
        t.matrix(f"{p}.attn_k.weight", kvh * hd, dim, 1.5)
        t.vector(f"{p}.attn_k_norm.weight", hd, 0.5)
        if s.swa(il):  # full layers have no attn_v: v is k's projection
            t.matrix(f"{p}.attn_v.weight", kvh * hd, dim)
    t.matrix(f"{p}.attn_output.weight", dim, s.heads * hd)
    ple = (("inp_gate", s.per_layer, dim), ("proj", dim, s.per_layer)) if s.per_layer else ()
    for name, rows, cols in (("ffn_gate", ffn, dim), ("ffn_up", ffn, dim), ("ffn_down", dim, ffn), *ple):
        t.matrix(f"{p}.{name}.weight", rows, cols)
    if s.experts:
        _experts(w, t, rng, s, p)
    w.add_tensor(f"{p}.layer_output_scale.weight", rng.uniform(0.5, 1.5, 1).astype(np.float32))


def _experts(w, t: RandomTensors, rng: np.random.Generator, s: Shape, p: str) -> None:
    """The router (its weights, its input scale), the experts' norms and matrices, their down scales."""
    E, f, dim = s.experts, s.expert_ffn, s.dim
    w.add_tensor(f"{p}.ffn_gate_inp.weight", (rng.standard_normal((E, dim)) * ROUTER_STD).astype(np.float32))
    for name in (
        "ffn_gate_inp.scale",
        "pre_ffw_norm_2.weight",
        "post_ffw_norm_1.weight",
        "post_ffw_norm_2.weight",
    ):
        t.vector(f"{p}.{name}", dim)
    gate_up = (rng.standard_normal((E, 2 * f, dim)) * 1.5 / np.sqrt(dim)).astype(np.float32)
    down = (rng.standard_normal((E, dim, f)) / np.sqrt(f)).astype(np.float32)
    if s.fused_experts:
        _add(t, f"{p}.ffn_gate_up_exps.weight", gate_up)
    else:
        _add(t, f"{p}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :f]))
        _add(t, f"{p}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, f:]))
    _add(t, f"{p}.ffn_down_exps.weight", down)
    w.add_tensor(f"{p}.ffn_down_exps.scale", rng.uniform(0.5, 2.0, E).astype(np.float32))


def _add(t: RandomTensors, name: str, data: np.ndarray) -> None:
    """An (experts, rows, cols) tensor in the file's quant, as RandomTensors.matrix writes matrices."""
    from gguf.quants import quantize

    if t.quant == "F32":
        t.w.add_tensor(name, data)
    else:
        t.w.add_tensor(name, quantize(data, t.qtype), raw_dtype=t.qtype)
