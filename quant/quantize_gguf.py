"""Quantize a whole GGUF file, as llama-quantize does for the types we have quantizers for.

All metadata is copied (general.file_type and general.quantization_version updated); 1-D tensors, norms
and the tensors llama.cpp never quantizes stay float (F32); a tensor whose rows are not whole blocks of
its type stays F32 (a Q6_K one whose rows are not whole super-blocks gets Q8_0, as llama.cpp falls
back); the output projection (the token embedding when it is tied) gets Q6_K, or Q8_0 when the target
is Q8_0 or its rows are not whole super-blocks, as llama.cpp chooses; F16/F32 targets convert all.
The Q4_K_M/Q5_K_M mixes give attn_v and ffn_down Q6_K in the layers llama.cpp picks (_use_more_bits)
and fall back to Q5_0/Q5_1 where rows are not whole super-blocks; on SmolLM2 every tensor comes out
byte-identical to llama-quantize's (Q4_0 ... Q8_0, Q6_K, Q4_K_M, Q5_K_M).
The file is written under a temporary name and renamed into place at the end, so a failed or
interrupted run never leaves a half-written file under the output name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LocalLLMError
from ..partial_file import partial_output
from . import dequantize, is_supported, quantize_k, quantize_legacy, quantize_mxfp4, type_name
from .ggml import BLOCK_KERNELS
from .types import QUANT_BY_NAME

QUANTIZERS = {**quantize_legacy.QUANTIZERS, **quantize_k.QUANTIZERS, **quantize_mxfp4.QUANTIZERS}
FLOAT_TARGETS = ("F32", "F16")
# llama.cpp's mixes: their base type, some tensors raised to Q6_K (see choose_type); Q4_K/Q5_K name them
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
# llama.cpp's MXFP4_MOE: expert tensors (3-D) MXFP4, every other quantized tensor Q8_0
MOE_MIX = "MXFP4_MOE"
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "MXFP4": MOE_MIX}  # as llama-quantize reads them
TARGETS = (*QUANTIZERS, *MIXES, MOE_MIX, *FLOAT_TARGETS)
# llama_ftype of a file of that type (general.file_type)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}
FILE_TYPES |= {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, MOE_MIX: 38}
# llama.cpp's stand-in when rows are not whole 256-element super-blocks
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
FLOAT_SOURCES = ("F32", "F16", "BF16")
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, written by llama-quantize
_CHUNK_ELEMENTS = 1 << 20  # rows are converted this many elements at a time
# Weights llama.cpp never quantizes (substrings of their names), besides 1-D tensors and norms.
_KEEP_FLOAT = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight", "altup")


@dataclass(slots=True)
class Plan:
    """One tensor: its name, logical shape (numpy order), source type and output type."""

    name: str
    shape: tuple[int, ...]
    source: str
    target: str


@dataclass(slots=True)
class QuantizeReport:
    target: str
    source_bytes: int
    output_bytes: int
    types: dict[str, int] = field(default_factory=dict)  # output type -> tensor count


def check_target(target: str) -> str:
    name = ALIASES.get(target.upper(), target.upper())
    if name not in TARGETS:
        raise LocalLLMError(f"unknown quantization type '{target}' (choose {', '.join(TARGETS)})")
    return name


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith(".weight") and not any(k in name for k in _KEEP_FLOAT)


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes: the first and last eighth,
    and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _role(name: str) -> str | None:
    """The tensors whose type the _M mixes vary by layer: V projections (fused QKV too) and ffn_down."""
    if any(f".{k}.weight" in name for k in ("attn_v", "attn_qkv", "attn_kv_b")):
        return "attn_v"
    return "ffn_down" if name.endswith(".ffn_down.weight") else None


def choose_type(
    name: str, shape: tuple[int, ...], target: str, tied: bool, layer: tuple[int, int] | None = None
) -> str:
    """The output type of one tensor when the file's type is `target`; `layer` is the tensor's index
    among those of its role (_role) in the file, and how many there are."""
    if not _quantizable(name, shape):
        return "F32"
    if target == MOE_MIX:
        target = "MXFP4" if len(shape) == 3 else "Q8_0"
        return target if shape[-1] % QUANT_BY_NAME[target].block_size == 0 else "F32"
    mix, target = target, MIXES.get(target, target)
    if target not in FLOAT_TARGETS and (name == "output.weight" or (tied and name == "token_embd.weight")):
        target = "Q8_0" if target == "Q8_0" else "Q6_K"  # the most sensitive tensor: llama.cpp keeps it high
    elif mix in MIXES and layer is not None and _use_more_bits(*layer):
        target = "Q6_K"
    if shape[-1] % QUANT_BY_NAME[target].block_size:
        target = _FALLBACK.get(target, target)
    return target if shape[-1] % QUANT_BY_NAME[target].block_size == 0 else "F32"


def _block_number(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def layer_positions(names: list[str]) -> dict[str, tuple[int, int]]:
    """Per tensor of a varying role: (its layer, the count of that role's tensors).  llama.cpp visits
    tensors in layer order whatever the file's order (blk.10 may come before blk.2), so the index is the
    block number, or the position in the file for a tensor outside the blocks."""
    by_role: dict[str, list[str]] = {}
    for name in names:
        if (role := _role(name)) is not None:
            by_role.setdefault(role, []).append(name)
    out = {}
    for group in by_role.values():
        for i, name in enumerate(group):
            block = _block_number(name)
            out[name] = (i if block is None else block, len(group))
    return out


def make_plan(reader: Any, target: str, allow_requantize: bool) -> list[Plan]:
    names = [t.name for t in reader.tensors]
    tied, layers = "output.weight" not in names, layer_positions(names)
    plans = []
    for t in reader.tensors:
        source = type_name(t.tensor_type)
        if not is_supported(t.tensor_type):
            raise LocalLLMError(f"tensor {t.name} has type {source}, which localllm cannot read")
        shape = tuple(int(n) for n in reversed(t.shape))
        target_type = choose_type(t.name, shape, target, tied, layers.get(t.name))
        if source not in FLOAT_SOURCES and not allow_requantize and _quantizable(t.name, shape):
            raise LocalLLMError(
                f"the input is already quantized (tensor {t.name} is {source}); pass --allow-requantize "
                "to dequantize and quantize it again (quality is lower than from an F16/F32 source)"
            )
        plans.append(Plan(t.name, shape, source, target_type))
    return plans


def convert_rows(rows: np.ndarray, target: str) -> np.ndarray:
    """float32 rows (r, n) -> the target's storage: float arrays, or bytes (r, row_bytes) for block types."""
    if target == "F32":
        return np.ascontiguousarray(rows, dtype=np.float32)
    if target == "F16":
        return rows.astype(np.float16)
    layout, block_size, _ = BLOCK_KERNELS[target]
    blocks = QUANTIZERS[target](np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, block_size))
    return blocks.view(np.uint8).reshape(rows.shape[0], -1)


def convert_tensor(data: np.ndarray, ggml_type: int, plan: Plan) -> np.ndarray:
    """A reader tensor's raw data -> the planned output, dequantized and converted in chunks of rows."""
    raw = data.reshape(-1, data.shape[-1]) if data.ndim else data.reshape(1, 1)
    n = plan.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // max(n, 1))
    parts = [
        convert_rows(dequantize(raw[i : i + step], ggml_type).reshape(-1, n), plan.target)
        for i in range(0, raw.shape[0], step)
    ]
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return out.reshape(*plan.shape[:-1], out.shape[-1])


def _copy_metadata(reader: Any, writer: Any, target: str) -> None:
    from gguf import GGUFValueType

    # the writer aligns tensor data its own way (32 bytes), so a copied general.alignment could lie
    skip = {"general.architecture", "general.alignment", "general.file_type", "general.quantization_version"}
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub)
    writer.add_uint32("general.file_type", FILE_TYPES[target])
    writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)


def _output_bytes(plan: Plan) -> int:
    rows = int(np.prod(plan.shape[:-1], dtype=np.int64))
    return rows * QUANT_BY_NAME[plan.target].row_bytes(plan.shape[-1])


def _architecture(reader: Any) -> str:
    f = reader.fields.get("general.architecture")
    if f is None:
        raise LocalLLMError("the input has no general.architecture: not a model GGUF")
    return str(f.contents())


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except FileNotFoundError:
        raise LocalLLMError(f"{path}: no such file") from None
    except (ValueError, OSError) as e:
        raise LocalLLMError(f"{path} is not a readable GGUF file ({e})") from None


Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, name of the one just written)


def quantize_file(
    src: str | Path,
    dst: str | Path,
    target: str,
    allow_requantize: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> QuantizeReport:
    """Write `src` quantized to `target` as `dst` (see the module's docstring for what goes where)."""
    target = check_target(target)
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise LocalLLMError(f"{dst} exists; pass --force to overwrite it")
    if dst.resolve() == src.resolve():
        raise LocalLLMError("the output must be another file than the input")
    reader = _open_reader(src)
    plans = make_plan(reader, target, allow_requantize)
    with partial_output(dst) as tmp:  # removed on errors and signals; a SIGKILL's by the next run
        report = _write(reader, plans, tmp, target, progress)
        os.replace(tmp, dst)
    report.source_bytes = src.stat().st_size
    return report


def _write(
    reader: Any, plans: list[Plan], path: Path, target: str, progress: Progress | None
) -> QuantizeReport:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, _architecture(reader))
    _copy_metadata(reader, writer, target)
    for plan in plans:
        raw = GGMLQuantizationType[plan.target]
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), _output_bytes(plan), raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    report = QuantizeReport(target, 0, 0)
    for done, (plan, tensor) in enumerate(zip(plans, reader.tensors, strict=True), 1):
        writer.write_tensor_data(convert_tensor(tensor.data, tensor.tensor_type, plan))
        report.types[plan.target] = report.types.get(plan.target, 0) + 1
        if progress is not None:
            progress(done, len(plans), plan.name)
    writer.close()
    report.output_bytes = path.stat().st_size
    return report
