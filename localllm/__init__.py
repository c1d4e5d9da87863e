"""localllm: run quantized LLMs locally. Public API: LLM, SamplingParams.

Imports stay light: numba, jinja2 and HTTP stacks load only when a model is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from localllm.llm import LLM
    from localllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from localllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from localllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'localllm' has no attribute {name!r}")
