"""What a model's weights take on a torch device, predicted from the file without importing torch.

The torch back end keeps the block types below quantized on a GPU (torch_backend/weights.py repacks
their blocks losslessly into planes: the same bytes, except Q4_K/Q5_K's twelve bytes of packed scales
spread to sixteen), holds vectors (norms, biases) as float32 and every other matrix dense: a float
file's own type on CUDA, else bf16 (fp16 on MPS and on cards without bf16). `info` prints this so a
user knows before loading whether a model fits the card.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from localllm.quant import type_name

# types whose blocks stay quantized on the device, and the bytes the repack adds per block
DEVICE_QUANTIZED: dict[str, int] = {
    "Q4_0": 0,
    "Q4_1": 0,
    "Q5_0": 0,
    "Q5_1": 0,
    "Q8_0": 0,
    "Q4_K": 4,
    "Q5_K": 4,
    "Q6_K": 0,
    "MXFP4": 0,
}
_BLOCK = {"Q4_K": 256, "Q5_K": 256}
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def device_weight_bytes(tensors: Iterable[Any], device: str = "cuda", quantized: bool = True) -> int:
    """Bytes the torch back end allocates for the weights of `tensors` (GGUF tensor infos with
    ggml_type, shape and nbytes) on `device` ("cuda", "mps" or "cpu"), quantized or all dense."""
    return sum(_tensor_bytes(t, device, quantized) for t in tensors)


def _tensor_bytes(t: Any, device: str, quantized: bool) -> int:
    numel = math.prod(int(d) for d in t.shape)
    if len(t.shape) == 1:
        return 4 * numel  # vectors are float32 on every device
    name = type_name(t.ggml_type)
    if quantized and name in DEVICE_QUANTIZED:
        return int(t.nbytes) + DEVICE_QUANTIZED[name] * (numel // _BLOCK.get(name, 32))
    if device == "cpu":
        return 4 * numel  # float32 on the CPU
    if device == "cuda" and name in _FLOAT_BYTES:
        return _FLOAT_BYTES[name] * numel
    return 2 * numel  # bf16 / fp16
