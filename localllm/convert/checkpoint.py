"""A Hugging Face checkpoint directory's config.json and *.safetensors tensors (sharded ones through
model.safetensors.index.json), read with the `safetensors` package.  Its NumPy API has no bfloat16, so
BF16 tensors are read as raw 16-bit words from the header's offsets and widened to float32 (exact)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localllm.convert.check import check_config, quoted, read_json
from localllm.errors import LocalLLMError

_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True)
class TensorRef:
    name: str
    file: Path
    dtype: str  # safetensors' name: F32, F16, BF16 ...
    shape: tuple[int, ...]


def read_config(hf_dir: Path) -> dict[str, Any]:
    """config.json, its hyper-parameters checked (localllm.convert.check)."""
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise LocalLLMError(f"{hf_dir} is not a directory (a Hugging Face checkpoint directory is expected)")
    config = read_json(path)
    if config is None:
        raise LocalLLMError(f"{hf_dir} has no config.json: not a Hugging Face checkpoint directory")
    return check_config(config, path)


def tensor_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if _is_file(index):
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        names = weight_map.values() if isinstance(weight_map, dict) else [None]
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
        if bad or not weight_map:
            raise LocalLLMError(f"{index}: weight_map must map tensor names to shard files in {hf_dir}")
        files = [hf_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [quoted(f.name) for f in files if not _is_file(f)]
        if missing:
            raise LocalLLMError(f"{index.name} names shards that are missing: {', '.join(missing[:5])}")
        return files
    files = sorted(f for f in hf_dir.glob("*.safetensors") if f.is_file())
    if not files:
        raise LocalLLMError(f"{hf_dir} holds no *.safetensors files (PyTorch .bin checkpoints are not read)")
    return files


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the file system or with a NUL: no such shard
        return False


def list_tensors(files: list[Path]) -> list[TensorRef]:
    from safetensors import SafetensorError, safe_open

    refs = []
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    s = f.get_slice(name)
                    refs.append(TensorRef(name, file, s.get_dtype(), tuple(s.get_shape())))
        except (SafetensorError, OSError) as e:
            raise LocalLLMError(f"{file.name} is not a readable safetensors file ({e})") from None
    seen: dict[str, Path] = {}
    for r in refs:
        if r.dtype not in _FLOAT_DTYPES:
            raise LocalLLMError(f"tensor {r.name} in {r.file.name} is {r.dtype}; convert reads float ones")
        if r.name in seen:
            raise LocalLLMError(f"tensor {r.name} is in both {seen[r.name].name} and {r.file.name}")
        seen[r.name] = r.file
    return refs


def load_tensor(ref: TensorRef) -> np.ndarray:
    """The tensor as float32."""
    if ref.dtype == "BF16":
        return _load_bf16(ref)
    from safetensors import safe_open

    with safe_open(ref.file, framework="np") as f:
        return np.asarray(f.get_tensor(ref.name), dtype=np.float32)


def _load_bf16(ref: TensorRef) -> np.ndarray:
    with open(ref.file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(n))[ref.name]["data_offsets"]
    words = np.memmap(ref.file, dtype="<u2", mode="r", offset=8 + n + start, shape=((end - start) // 2,))
    return (words.astype(np.uint32) << 16).view(np.float32).reshape(ref.shape)
