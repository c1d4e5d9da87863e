"""Fill-in-the-middle: a model's FIM tokens and the prompt that asks it for the middle.

The tokens come from the GGUF (`tokenizer.ggml.fim_{pre,suf,mid}_token_id`), else from the vocabulary's
known spellings (Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`, CodeLlama's `<PRE>`,
DeepSeek-Coder's `<｜fim▁begin｜>`, ...), as llama.cpp recognises them. The prompt is llama-server's
/infill order (prefix-suffix-middle): [BOS] <pre> prefix <suf> suffix <mid>, the model then writes the
middle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localllm.tokenizer.base import Tokenizer

SPELLINGS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
}


@dataclass(frozen=True, slots=True)
class FimTokens:
    pre: int
    suf: int
    mid: int


def fim_tokens(tokenizer: Tokenizer, metadata: Mapping[str, Any]) -> FimTokens | None:
    """The model's prefix, suffix and middle tokens, or None when it lacks any of them."""
    found = {}
    for role, spellings in SPELLINGS.items():
        value = metadata.get(f"tokenizer.ggml.fim_{role}_token_id")
        if isinstance(value, int) and 0 <= value < tokenizer.vocab_size:
            found[role] = value
            continue
        ids = [tokenizer.piece_to_id(s) for s in spellings]
        match = next((i for i in ids if i is not None), None)
        if match is None:
            return None
        found[role] = match
    return FimTokens(**found)


def infill_ids(tokenizer: Tokenizer, fim: FimTokens, prefix: str | list[int], suffix: str) -> list[int]:
    """The prompt asking for the text between `prefix` (text, or token ids) and `suffix`. User text is
    tokenized without parsing special tokens, as llama-server's /infill does."""
    head = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    pre = prefix if isinstance(prefix, list) else tokenizer.encode(prefix, add_special=False)
    suf = tokenizer.encode(suffix, add_special=False)
    return [*head, fim.pre, *pre, fim.suf, *suf, fim.mid]
