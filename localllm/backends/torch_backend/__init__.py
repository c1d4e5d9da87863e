"""The PyTorch backend (backend.py) and its parts: the device and dense weight type (device.py),
quantized weights on the device (weights.py) and the matmuls over them (qlinear.py, triton_quant.py),
paged attention (attention.py), fixed-shape decode for CUDA graphs (static.py) and sampling on the
device (sampling.py). Importing it imports torch; Triton only where a kernel is about to run."""

from localllm.backends.torch_backend.backend import CACHE_DTYPES, TorchBackend
from localllm.backends.torch_backend.device import DEVICES, resolve_device, weight_dtype
from localllm.backends.torch_backend.static import MAX_STATIC_BATCH

__all__ = ["CACHE_DTYPES", "DEVICES", "MAX_STATIC_BATCH", "TorchBackend", "resolve_device", "weight_dtype"]
