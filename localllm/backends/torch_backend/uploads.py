"""Host-to-device copies of a step's small index arrays: packed into one buffer and copied once. On
CUDA the buffer is pinned (torch's caching host allocator reuses the blocks, and keeps one until the
copy that reads it is done), so the copy is asynchronous: the host goes on queueing the step's kernels
instead of waiting for the stream, as a copy from pageable memory does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload_ints(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 device copies of `arrays` (shapes kept), in one host-to-device copy."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    packed = torch.from_numpy(np.concatenate(flat) if flat else np.empty(0, np.int64))
    if device.type == "cuda":
        packed = packed.pin_memory()
    on_device = packed.to(device, non_blocking=True)
    out, start = [], 0
    for a, f in zip(arrays, flat, strict=True):
        out.append(on_device[start : start + f.size].view(np.shape(a)))
        start += f.size
    return out


def upload_one(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """One array, asynchronously where the device allows; float64 arrives as float32 on MPS (which
    has no float64)."""
    if device.type == "mps" and a.dtype == np.float64:
        a = a.astype(np.float32)
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
