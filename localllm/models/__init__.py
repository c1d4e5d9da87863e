"""Architectures by `general.architecture`. Each module only reads hyper-parameters into ModelArgs
(one LayerSpec per layer) and may rename tensors; transformer.Transformer runs all of them."""

from __future__ import annotations

import importlib
from typing import Any

from localllm.architectures import ARCHITECTURES
from localllm.errors import ModelFormatError


def load_model(gf: Any, backend: Any) -> Any:
    """Build the model for the GGUF's architecture, or say which architecture is unsupported."""
    from localllm.models.transformer import Transformer

    arch = gf.architecture
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelFormatError(
            f"{gf.path.name} uses the '{arch}' architecture, which localllm does not support "
            f"(supported: {supported})"
        )
    module = importlib.import_module(ARCHITECTURES[arch])
    return Transformer(gf, backend, module.read_args(gf), getattr(module, "TENSOR_NAMES", None))
