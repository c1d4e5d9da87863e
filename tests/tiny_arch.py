"""Tiny random-weight GGUFs of every supported architecture, each exercising its LayerSpec fields.

llama with a sliding window and linear RoPE scaling, qwen2 (q/k/v biases, NEOX RoPE) and gemma3 (q/k
norms, post-norms, GeGLU, local/global RoPE bases, a 16-token window on five of six layers), with the
byte-level BPE vocabulary of tiny_model.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tiny_model import CHATML, vocabulary

DIM, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
ARCHS = ("llama", "qwen2", "gemma3")


def _metadata(w, arch: str, n_layers: int, window: int, rope_scale: float) -> None:
    import gguf

    tokens, types, merges = vocabulary()
    w.add_block_count(n_layers)
    w.add_context_length(512)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if window:
        w.add_sliding_window(window)
    if arch == "llama" and rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scale)
    if arch == "gemma3":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def write_arch_model(path: Path, arch: str, quant: str = "Q8_0", n_layers: int = 6, window: int = 16,
                     seed: int = 1, rope_scale: float = 2.0) -> Path:  # fmt: skip
    """A random `arch` model; `window` applies to every llama layer and to gemma3's local layers,
    `rope_scale` is llama's linear RoPE scaling factor."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, n_layers, window, rope_scale)
    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.5 / np.sqrt(cols)).astype(np.float32)
        if quant == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, spread: float = 0.1) -> None:
        w.add_tensor(name, (1.0 + spread * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", len(vocabulary()[0]), DIM)
    vector("output_norm.weight", DIM)
    nq, nkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for il in range(n_layers):
        p = f"blk.{il}"
        for name, n in (("attn_norm", DIM), ("ffn_norm", DIM)):
            vector(f"{p}.{name}.weight", n)
        for name, rows, cols in (("attn_q", nq, DIM), ("attn_k", nkv, DIM), ("attn_v", nkv, DIM),
                                 ("attn_output", DIM, nq), ("ffn_gate", FFN, DIM), ("ffn_up", FFN, DIM),
                                 ("ffn_down", DIM, FFN)):  # fmt: skip
            matrix(f"{p}.{name}.weight", rows, cols)
        if arch == "qwen2":
            for name, n in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
                w.add_tensor(f"{p}.{name}.bias", (0.3 * rng.standard_normal(n)).astype(np.float32))
        if arch == "gemma3":
            for name, n in (("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM),
                            ("post_attention_norm", DIM), ("post_ffw_norm", DIM)):  # fmt: skip
                vector(f"{p}.{name}.weight", n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
