"""config.json <-> GGUF hyper-parameters (`{arch}.*` keys, as llama.cpp's convert_hf_to_gguf writes them)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from localllm.convert.names import HF_ARCHITECTURE, MODEL_TYPE
from localllm.errors import LocalLLMError

# GGUF key (after "{arch}.") <- config.json key; written when the config has it
_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_FLOATS = {"rope.freq_base", "attention.layer_norm_rms_epsilon"}


def gguf_hparams(arch: str, config: dict[str, Any]) -> dict[str, int | float]:
    """The `{arch}.*` values for a config.json (checked by localllm.convert.check); refuses what the
    GGUF could not say (rope scaling kinds llama.cpp handles with extra tensors)."""
    out: dict[str, int | float] = {}
    for key, hf in _KEYS.items():
        if config.get(hf) is not None:
            out[key] = float(config[hf]) if key in _FLOATS else int(config[hf])
    out.setdefault("attention.head_count_kv", out["attention.head_count"])
    head_dim = int(config.get("head_dim") or out["embedding_length"] // out["attention.head_count"])
    if arch == "llama":
        if config.get("vocab_size"):
            out["vocab_size"] = int(config["vocab_size"])
        out["rope.dimension_count"] = head_dim
    if arch == "gemma3":
        out["attention.key_length"] = out["attention.value_length"] = head_dim
        if config.get("sliding_window"):
            out["attention.sliding_window"] = int(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            out["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    out.update(_rope_scaling(config.get("rope_scaling")))
    return out


def _rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any]:
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(scaling["factor"])}
    if kind == "llama3":
        return {}  # a rope_freqs.weight tensor instead (llama3_rope_factors)
    raise LocalLLMError(
        f"rope_scaling of type {kind!r:.80} is not supported by localllm convert (linear, llama3)"
    )


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """Llama 3.1's RoPE frequency divisors per dimension pair (the rope_freqs.weight llama.cpp writes):
    1 for wavelengths under original_context / high_freq_factor, `factor` above original_context /
    low_freq_factor, a smooth blend between."""
    s = config.get("rope_scaling") or {}
    if s.get("rope_type", s.get("type")) != "llama3":
        return None
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    freqs = 1.0 / (float(config.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    out = []
    for wavelen in 2 * math.pi / freqs.astype(np.float64):
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_config(arch: str, hp: dict[str, Any], tied: bool, bos: int | None, eos: int | None) -> dict[str, Any]:
    """A config.json for GGUF hyper-parameters `hp` (keys without the "{arch}." prefix)."""
    config: dict[str, Any] = {"architectures": [HF_ARCHITECTURE[arch]], "model_type": MODEL_TYPE[arch]}
    for key, hf in _KEYS.items():
        if key in hp:
            config[hf] = hp[key]
    config["num_key_value_heads"] = hp.get("attention.head_count_kv", hp["attention.head_count"])
    config["hidden_act"] = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    config["tie_word_embeddings"] = tied
    config["bos_token_id"], config["eos_token_id"] = bos, eos
    config["torch_dtype"] = "float32"
    if arch == "gemma3":
        config["head_dim"] = config["query_pre_attn_scalar"] = hp["attention.key_length"]
        config["sliding_window"] = hp.get("attention.sliding_window")
        config["final_logit_softcapping"] = hp.get("final_logit_softcapping")
    if "rope.scaling.type" in hp:
        config["rope_scaling"] = {"rope_type": hp["rope.scaling.type"], "factor": hp["rope.scaling.factor"]}
    return config
