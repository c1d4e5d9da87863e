"""Architectures by `general.architecture`; each lives in its own module."""

from __future__ import annotations

from typing import Any

from localllm.errors import ModelFormatError

ARCHITECTURES = {
    "llama": ("localllm.models.llama", "LlamaModel"),
    "qwen2": ("localllm.models.qwen2", "Qwen2Model"),
    "gemma3": ("localllm.models.gemma3", "Gemma3Model"),
}


def load_model(gf: Any, backend: Any) -> Any:
    """Build the model for the GGUF's architecture, or say which architecture is unsupported."""
    import importlib

    arch = gf.architecture
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelFormatError(
            f"{gf.path.name} uses the '{arch}' architecture, which localllm does not support "
            f"(supported: {supported})"
        )
    module_name, class_name = ARCHITECTURES[arch]
    return getattr(importlib.import_module(module_name), class_name)(gf, backend)
