"""Backend selection. Imports happen here, lazily, so `import localllm` stays light."""

from __future__ import annotations

from typing import Any

from localllm.errors import ConfigError


def make_backend(name: str, threads: int) -> Any:
    if name == "numpy":
        from localllm.backends.numpy_ref import NumpyBackend

        return NumpyBackend()
    if name == "numba":
        from localllm.backends.numba_cpu import NumbaBackend

        return NumbaBackend(threads)
    if name == "torch":
        raise ConfigError(
            "the torch backend is not available yet in this version of localllm; use --backend numba"
        )
    raise ConfigError(f"unknown backend '{name}' (choose numba or numpy)")
