"""The supported architectures and the GGUF names of a layer's tensors: plain data that the loader's
checks (loading/checks.py, models/checks.py) and the model code (models/) both read, with no imports,
so neither imports the other."""

from __future__ import annotations

# general.architecture -> the module that reads its hyper-parameters into ModelArgs
ARCHITECTURES = {
    "llama": "localllm.models.llama",
    "qwen2": "localllm.models.qwen2",
    "gemma3": "localllm.models.gemma3",
    "qwen3": "localllm.models.qwen3",
    "gemma2": "localllm.models.gemma2",
    "phi3": "localllm.models.phi3",
    "qwen3moe": "localllm.models.qwen3moe",
    "qwen2moe": "localllm.models.qwen2moe",
    "qwen35": "localllm.models.qwen35",
    "qwen35moe": "localllm.models.qwen35moe",
    "qwen3next": "localllm.models.qwen35moe",
    "gpt-oss": "localllm.models.gptoss",
    "smollm3": "localllm.models.smollm3",
    "mistral3": "localllm.models.mistral3",
    "gemma4": "localllm.models.gemma4",
}

# GGUF tensor names (llama.cpp's) of a layer's weights; an architecture may rename some.
TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
    # mixture of experts: the router, the experts' (experts, rows, cols) tensors, the shared expert's gate
    "router": "ffn_gate_inp.weight",
    "gate_exps": "ffn_gate_exps.weight",
    "up_exps": "ffn_up_exps.weight",
    "down_exps": "ffn_down_exps.weight",
    "shexp_gate": "ffn_gate_inp_shexp.weight",
    # Gated DeltaNet (models/gated_delta.py)
    "ssm_qkv": "attn_qkv.weight",
    "ssm_z": "attn_gate.weight",
    "ssm_beta": "ssm_beta.weight",
    "ssm_alpha": "ssm_alpha.weight",
    "ssm_conv": "ssm_conv1d.weight",
    "ssm_dt": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    # gpt-oss: attention sinks (one logit per head) and the biases of the output and the experts
    "sinks": "attn_sinks.weight",
    "bo": "attn_output.bias",
    "router_b": "ffn_gate_inp.bias",
    "gate_exps_b": "ffn_gate_exps.bias",
    "up_exps_b": "ffn_up_exps.bias",
    "down_exps_b": "ffn_down_exps.bias",
    # gemma4's parallel experts: their input norm, the dense FFN's and their output norms, the router's
    # input scale and each expert's down scale
    "ffn_norm_2": "pre_ffw_norm_2.weight",
    "post_ffn_norm_1": "post_ffw_norm_1.weight",
    "post_ffn_norm_2": "post_ffw_norm_2.weight",
    "router_norm": "ffn_gate_inp.scale",
    "down_exps_s": "ffn_down_exps.scale",
    # gemma4's per-layer inputs: the gate into, projection out of and norm of each layer's embedding
    "ple_gate": "inp_gate.weight",
    "ple_proj": "proj.weight",
    "ple_norm": "post_norm.weight",
}
