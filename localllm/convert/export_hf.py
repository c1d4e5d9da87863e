"""A GGUF -> a Hugging Face checkpoint directory (config.json, model.safetensors or shards with an index,
tokenizer files): the inverse of convert_hf, so tests can make checkpoints from the models we have.
Quantized tensors are dequantized; the llama family's q/k rows are un-permuted back to rotate-half
order and Gemma's stored 1 + w norms back to w."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from localllm.convert.hparams import hf_config
from localllm.convert.names import HF_ARCHITECTURE, hf_name, norm_shift, unpermute_qk
from localllm.convert.vocab import write_tokenizer_files
from localllm.errors import LocalLLMError


def gguf_metadata(reader: Any) -> dict[str, Any]:
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def hf_tensors(reader: Any, arch: str, meta: dict[str, Any], dtype: str) -> dict[str, np.ndarray]:
    from localllm.quant import dequantize

    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = dequantize(t.data, t.tensor_type).reshape(shape)
        kind = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            data = unpermute_qk(data, n_head if kind == "attn_q" else n_kv)
        if shift := norm_shift(arch, t.name):
            data = data - np.float32(shift)
        out[hf_name(arch, t.name)] = np.ascontiguousarray(data, dtype=dtype)
    return out


def export_hf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", shard_bytes: int = 0
) -> Path:
    """Write the GGUF as a Hugging Face directory; `shard_bytes` > 0 splits the weights into shards of
    about that size with a model.safetensors.index.json, as large checkpoints come."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf_path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in HF_ARCHITECTURE:
        raise LocalLLMError(f"cannot export a {arch} model ({', '.join(HF_ARCHITECTURE)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(reader, arch, meta, dtype)
    shards = _shards(tensors, shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / name)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    ids = write_tokenizer_files(meta, out)
    hp = {k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(f"{arch}.")}
    config = hf_config(arch, hp, "lm_head.weight" not in tensors, ids.get("bos"), ids.get("eos"))
    config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    config.update({f"{k}_token_id": v for k, v in ids.items()})
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _shards(tensors: dict[str, np.ndarray], shard_bytes: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shard_bytes and size and size + array.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards
