"""Tokenizers built from GGUF metadata that reproduce llama.cpp's token ids.

`load_tokenizer(metadata)` picks the implementation from `tokenizer.ggml.model`: "gpt2" is byte-level
BPE (bpe.py), "llama" is SentencePiece (spm.py). Both subclass `Tokenizer` (base.py), which this
package re-exports; the subclasses import base.py, not this package, so nothing imports in a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localllm.errors import ModelFormatError
from localllm.tokenizer.base import TokenAttr, Tokenizer

__all__ = ["Tokenizer", "TokenAttr", "load_tokenizer"]


def load_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (dispatching on tokenizer.ggml.model)."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        from localllm.tokenizer.bpe import BPETokenizer

        return BPETokenizer(metadata)
    if model == "gemma4":
        from localllm.tokenizer.bpe import Gemma4Tokenizer

        return Gemma4Tokenizer(metadata)
    if model == "llama":
        from localllm.tokenizer.spm import SPMTokenizer

        return SPMTokenizer(metadata)
    if model is None:
        raise ModelFormatError("the model file does not say which tokenizer it uses (tokenizer.ggml.model).")
    raise ModelFormatError(f"tokenizer model '{model}' is not supported.")
