"""Architectures by `general.architecture`. Each module only reads hyper-parameters into ModelArgs
(one LayerSpec per layer) and may rename tensors; transformer.Transformer runs all of them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from localllm.architectures import ARCHITECTURES
from localllm.errors import ModelFormatError

if TYPE_CHECKING:
    from localllm.backends.base import Backend
    from localllm.loading.file import GGUFFile
    from localllm.models.transformer import Transformer


def load_model(
    gf: GGUFFile, backend: Backend, n_ctx: int | None = None, weight_cache: Any = None
) -> Transformer:
    """Build the model for the GGUF's architecture, or say which architecture is unsupported. `n_ctx`
    is the context it will run (None: the trained one), for architectures whose weights depend on it
    (a module with READS_CONTEXT: Phi-3's LongRoPE). `weight_cache`: the backend's disk cache of gf's
    prepared weights (Backend.open_weight_cache), or None."""
    from localllm.models.transformer import Transformer

    arch = gf.architecture
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelFormatError(
            f"{gf.path.name} uses the '{arch}' architecture, which localllm does not support "
            f"(supported: {supported})"
        )
    module = importlib.import_module(ARCHITECTURES[arch])
    args = module.read_args(gf, n_ctx) if getattr(module, "READS_CONTEXT", False) else module.read_args(gf)
    return Transformer(gf, backend, args, getattr(module, "TENSOR_NAMES", None), weight_cache)
