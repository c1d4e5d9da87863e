"""Backend selection. Imports happen here, lazily, so `import localllm` stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localllm.errors import ConfigError

if TYPE_CHECKING:
    from localllm.backends.base import Backend


def make_backend(name: str, threads: int, device: str = "auto") -> Backend:
    """The backend `name`; `device` (auto, cuda, mps or cpu) is the torch backend's."""
    if name == "numpy":
        from localllm.backends.numpy_ref import NumpyBackend

        return NumpyBackend()
    if name == "numba":
        from localllm.backends.numba_cpu import NumbaBackend

        return NumbaBackend(threads)
    if name == "torch":
        try:
            import torch  # noqa: F401  (only to tell a missing install from a broken backend)
        except ImportError:
            raise ConfigError("the torch backend needs PyTorch: pip install 'localllm[torch]'") from None
        from localllm.backends.torch_backend import TorchBackend

        return TorchBackend(threads, device)
    raise ConfigError(f"unknown backend '{name}' (choose numba, numpy or torch)")
