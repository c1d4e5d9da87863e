"""Tensor names and hyper-parameters of the families we convert: Hugging Face <-> GGUF (llama.cpp's)."""

from __future__ import annotations

import re

from localllm.errors import LocalLLMError

# config.json "architectures"[0] -> GGUF general.architecture
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
}
HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
# Gemma 3 has four norms per layer and q/k norms: llama's post_attention_layernorm is its ffn_norm.
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_LAYERS = {"llama": _LAYER, "qwen2": _LAYER, "gemma3": _GEMMA3_LAYER}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_name(arch: str, hf: str) -> str | None:
    """The GGUF name of a Hugging Face tensor, None for one llama.cpp drops (rotary inv_freq)."""
    if hf.endswith("rotary_emb.inv_freq"):
        return None
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m and m.group(2) in _LAYERS[arch]:
        return f"blk.{m.group(1)}.{_LAYERS[arch][m.group(2)]}"
    raise LocalLLMError(f"tensor {hf} has no GGUF name for a {arch} model (not a {arch} checkpoint?)")


def hf_name(arch: str, gguf: str) -> str:
    inverse_global = {v: k for k, v in _GLOBAL.items()}
    if gguf in inverse_global:
        return inverse_global[gguf]
    m = _GGUF_LAYER.fullmatch(gguf)
    inverse = {v: k for k, v in _LAYERS[arch].items()}
    if m and m.group(2) in inverse:
        return f"model.layers.{m.group(1)}.{inverse[m.group(2)]}"
    raise LocalLLMError(f"GGUF tensor {gguf} has no Hugging Face name for {arch}")


def norm_shift(arch: str, gguf: str) -> float:
    """Gemma's RMSNorm multiplies by (1 + w): llama.cpp stores w + 1."""
    return 1.0 if arch == "gemma3" and gguf.endswith("norm.weight") else 0.0


def permute_qk(w, n_head: int):  # noqa: ANN001, ANN201 (numpy arrays)
    """Hugging Face's rotate-half q/k rows -> llama.cpp's interleaved pairs, per head (llama family only:
    each head's first and second halves of rows become its even and odd rows)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk(w, n_head: int):  # noqa: ANN001, ANN201
    """The inverse of permute_qk: even and odd rows of each head back to its two halves."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
