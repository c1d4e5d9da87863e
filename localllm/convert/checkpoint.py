"""A Hugging Face checkpoint directory's config.json and *.safetensors tensors (sharded ones through
model.safetensors.index.json), read with the `safetensors` package.  Its NumPy API has no bfloat16, so
BF16 tensors are read as raw 16-bit words from the header's offsets and widened to float32 (exact).

MXFP4 tensors as Hugging Face stores them (gpt-oss, transformers' Mxfp4Config): `<name>_blocks`, uint8
(..., rows, n / 32, 16), element 2i in the low nibble and 2i + 1 in the high one, and `<name>_scales`,
uint8 (..., rows, n / 32) E8M0 exponents, read as the one tensor `<name>.weight` (..., rows, n) of
dtype "MXFP4", its values exact in float32 (E2M1 times a power of two)."""

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
MXFP4 = "MXFP4"  # a TensorRef's dtype for a _blocks/_scales pair
_BLOCKS, _SCALES = "_blocks", "_scales"


@dataclass(slots=True)
class TensorRef:
    name: str
    file: Path
    dtype: str  # safetensors' name: F32, F16, BF16 ..., or MXFP4 (a _blocks/_scales pair)
    shape: tuple[int, ...]
    scales: TensorRef | None = None  # MXFP4: the _scales tensor (this ref's file holds the _blocks)


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
    refs = _pair_mxfp4(refs)
    seen: dict[str, Path] = {}
    for r in refs:
        if r.dtype not in (*_FLOAT_DTYPES, MXFP4):
            raise LocalLLMError(f"tensor {r.name} in {r.file.name} is {r.dtype}; convert reads float ones")
        if r.name in seen:
            raise LocalLLMError(f"tensor {r.name} is in both {seen[r.name].name} and {r.file.name}")
        seen[r.name] = r.file
    return refs


def _pair_mxfp4(refs: list[TensorRef]) -> list[TensorRef]:
    """Each `<name>_blocks` + `<name>_scales` pair of uint8 tensors as one MXFP4 ref `<name>.weight`."""
    by_name = {r.name: r for r in refs}
    out, paired = [], set()
    for r in refs:
        if not r.name.endswith(_BLOCKS) or r.dtype != "U8":
            continue
        base = r.name[: -len(_BLOCKS)]
        scales = by_name.get(base + _SCALES)
        if scales is None or scales.dtype != "U8":
            raise LocalLLMError(f"tensor {r.name} in {r.file.name} has no uint8 {base + _SCALES} beside it")
        if len(r.shape) < 3 or r.shape[-1] != 16 or scales.shape != r.shape[:-1]:
            raise LocalLLMError(
                f"MXFP4 tensor {base}: blocks {list(r.shape)} and scales {list(scales.shape)} should be "
                "(..., rows, n/32, 16) and (..., rows, n/32)"
            )
        name = base if base.endswith(".weight") else base + ".weight"
        out.append(TensorRef(name, r.file, MXFP4, (*r.shape[:-2], r.shape[-2] * 32), scales))
        paired |= {r.name, scales.name}
    return [r for r in refs if r.name not in paired] + out


def ggml_mxfp4(ref: TensorRef) -> np.ndarray:
    """An MXFP4 ref's bytes as ggml's block_mxfp4 rows (..., rows, n / 32 * 17): per block the scale
    byte, then 16 bytes holding element j in the low nibble and j + 16 in the high one (lossless)."""
    from safetensors import safe_open

    assert ref.scales is not None
    with safe_open(ref.file, framework="np") as f:
        blocks = np.asarray(f.get_tensor(ref.name.removesuffix(".weight") + _BLOCKS), np.uint8)
    with safe_open(ref.scales.file, framework="np") as f:
        scales = np.asarray(f.get_tensor(ref.scales.name), np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], axis=-1)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:-2], -1))


def load_tensor(ref: TensorRef) -> np.ndarray:
    """The tensor as float32."""
    if ref.dtype == "BF16":
        return _load_bf16(ref)
    if ref.dtype == MXFP4:
        from localllm.quant import dequantize
        from localllm.quant.types import QUANT_BY_NAME

        raw = ggml_mxfp4(ref)
        rows = dequantize(raw.reshape(-1, raw.shape[-1]), QUANT_BY_NAME[MXFP4].ggml_type)
        return rows.reshape(ref.shape).astype(np.float32)
    from safetensors import safe_open

    with safe_open(ref.file, framework="np") as f:
        return np.asarray(f.get_tensor(ref.name), dtype=np.float32)


def _load_bf16(ref: TensorRef) -> np.ndarray:
    with open(ref.file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(n))[ref.name]["data_offsets"]
    words = np.memmap(ref.file, dtype="<u2", mode="r", offset=8 + n + start, shape=((end - start) // 2,))
    return (words.astype(np.uint32) << 16).view(np.float32).reshape(ref.shape)
