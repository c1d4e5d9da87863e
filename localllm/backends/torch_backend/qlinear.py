"""Multiplying by quantized weights: Triton kernels where Triton runs (CUDA), else torch ops that
dequantize a chunk of rows at a time into float32 and multiply, so no dense copy of a whole matrix
(let alone the model) is ever held. Also where the weights' device memory is counted for the log."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from localllm.backends.torch_backend.weights import QuantWeight, dequantized_rows
from localllm.errors import ConfigError

log = logging.getLogger("localllm")

WEIGHT_MODES = ("auto", "dense", "quantized")
CHUNK_ELEMENTS = 1 << 24  # the torch path's dequantized rows per multiply: 64 MiB of float32


def weight_mode(device: torch.device, asked: str = "") -> str:
    """dense or quantized: as asked, else LOCALLLM_TORCH_WEIGHTS, else quantized on a GPU (memory is
    what runs out there) and dense float32 on the CPU (fastest there, and today's behaviour)."""
    mode = asked or os.environ.get("LOCALLLM_TORCH_WEIGHTS", "") or "auto"
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"LOCALLLM_TORCH_WEIGHTS={mode}: choose {', '.join(WEIGHT_MODES)}")
    if mode == "auto":
        return "dense" if device.type == "cpu" else "quantized"
    return mode


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA (and ROCm's torch.cuda); not for MPS or the CPU."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class QuantLinear:
    """x times a QuantWeight transposed, float32 out; `kernels` is "triton" or "torch"."""

    def __init__(self, device: torch.device, compute_dtype: torch.dtype):
        self.kernels = "triton" if triton_runs_on(device) else "torch"
        self.compute_dtype = compute_dtype  # the torch path's multiply (float32 on the CPU)
        self.precision = "tf32x3"  # the Triton GEMM's tl.dot input precision ("ieee": exact products)
        self._triton: Any = None
        if self.kernels == "triton":
            self._load_triton()

    def _load_triton(self) -> None:
        """Import the kernels now, so a Triton that does not work here is a warning at load (and the
        torch path), not an error at the first token."""
        try:
            from localllm.backends.torch_backend import triton_quant
        except Exception as e:  # a broken or mismatched install raises anything from ImportError on
            log.warning("torch backend: Triton kernels unavailable (%s); dequantizing with torch ops", e)
            self.kernels = "torch"
            return
        self._triton = triton_quant

    def __call__(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        if self.kernels == "triton" and self._triton is None:  # (kernels set after construction)
            self._load_triton()
        if self.kernels == "triton":
            return self._triton.matmul(x, w, precision=self.precision)
        return self._torch(x, w)

    def _torch(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        n, k = w.shape
        rows = max(1, CHUNK_ELEMENTS // k)
        xc = x.to(self.compute_dtype)
        if rows >= n:
            return F.linear(xc, dequantized_rows(w, 0, n).to(self.compute_dtype)).float()
        out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            out[:, start:stop] = F.linear(xc, dequantized_rows(w, start, stop).to(self.compute_dtype))
        return out


class WeightMemory:
    """Device bytes of the prepared weights, by kind (a GGUF type kept quantized, or the dense dtype)."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()

    def add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def describe(self) -> str:
        parts = ", ".join(f"{kind} {n / 2**20:.0f}" for kind, n in self.by_kind.most_common())
        return f"{self.total / 2**20:.0f} MiB ({parts} MiB)"
