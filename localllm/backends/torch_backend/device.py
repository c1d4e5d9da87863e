"""Which torch device runs the model, and the dense weight type each kind of device gets."""

from __future__ import annotations

import torch

from localllm.errors import ConfigError

DEVICES = ("auto", "cuda", "mps", "cpu")


def resolve_device(name: str) -> torch.device:
    """auto: CUDA, then MPS, then the CPU; an explicit device that is not there is refused in one line."""
    if name not in DEVICES:
        raise ConfigError(f"unknown device '{name}' (choose {', '.join(DEVICES)})")
    has = {"cuda": torch.cuda.is_available(), "mps": _has_mps(), "cpu": True}
    if name == "auto":
        name = next(d for d in ("cuda", "mps", "cpu") if has[d])
    if not has[name]:
        raise ConfigError(f"--device {name}: this PyTorch build sees no {name.upper()} device")
    return torch.device(name)


def _has_mps() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def weight_dtype(device: torch.device) -> torch.dtype:
    """The dense weight type: float32 on the CPU, so results track the NumPy oracle to float rounding
    (bf16 measured ~2x faster there on AVX512-BF16 CPUs, but it rounds every weight to an 8-bit
    mantissa); bf16 on CUDA where the card supports it (else fp16) and fp16 on MPS."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if device.type == "mps" else torch.float32


FILE_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML F32, F16, BF16


def dense_dtype(device: torch.device, ggml_type: int) -> torch.dtype:
    """A dense matrix's type: on CUDA a float file's own (no rounding: an F32 file's argmaxes are the
    oracle's), else weight_dtype (a type without kernels there, dequantized)."""
    if device.type == "cuda" and ggml_type in FILE_FLOATS:
        dtype = FILE_FLOATS[ggml_type]
        return dtype if dtype != torch.bfloat16 or torch.cuda.is_bf16_supported() else torch.float16
    return weight_dtype(device)
