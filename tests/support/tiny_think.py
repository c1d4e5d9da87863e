"""Tiny random models that think: the tiny llama with reasoning markers in its vocabulary and a chat
template that uses them (Qwen3-like `<think>` tags, or gpt-oss-like harmony channels), and a way to
script what such a model writes so tests can assert what the reasoning parsers make of real replies.

Scripting goes through the engine's own sampling step (ModelRunner._sample): the logits are masked to
the script's next token, so everything after sampling (detokenizing, stop tokens, max_tokens, the
reasoning budget's forced tokens, which win over the logits) runs as it does for a real model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tiny_model import vocabulary, write_tiny_model

THINK_TOKENS = ["<think>", "</think>"]  # user-defined tokens, as in Qwen3's GGUF
HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]

# Qwen3-like: past reasoning shown only after the last user message; enable_thinking=false writes an
# empty block into the generation prompt; `open_think` templates (DeepSeek-R1 distills) open it there.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ (m.content or '') + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif OPEN %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)
# gpt-oss-like: the effort in the system message, past thinking (`thinking`) as an analysis message.
HARMONY_LIKE = (
    "{{ '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + '<|end|>' }}"
    "{%- if tools %}{{ '<|start|>developer<|message|># Tools\\n' + (tools | tojson) + '<|end|>' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif %}{{ '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + m.role + '<|message|>' + (m.content or '') + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}"
)


def write_think_model(path: Path, open_think: bool = False) -> Path:
    """The tiny llama with `<think>` / `</think>` and a Qwen3-like template."""
    tokens, types, merges = vocabulary()
    vocab = (tokens + THINK_TOKENS, types + [4] * len(THINK_TOKENS), merges)
    template = QWEN3_LIKE.replace("OPEN", "true" if open_think else "false")
    return write_tiny_model(path, vocab=vocab, chat_template=template)


def write_harmony_model(path: Path) -> Path:
    """The tiny llama with harmony's markers (control tokens; `<|return|>` ends a reply) and a
    gpt-oss-like template."""
    tokens, types, merges = vocabulary()
    vocab = (tokens + HARMONY_TOKENS, types + [3] * len(HARMONY_TOKENS), merges)
    eos = len(tokens) + HARMONY_TOKENS.index("<|return|>")
    return write_tiny_model(path, vocab=vocab, chat_template=HARMONY_LIKE, eos_id=eos)


Script = Callable[[Any], list[int] | None]  # a sequence -> the token ids it writes (None: the model's own)


def script_replies(engine: Any, script: Script) -> None:
    """Make `engine` write `script(seq)`'s tokens (then the end-of-text token) in each sequence."""
    runner, original = engine.runner, type(engine.runner)._sample
    eos = engine.tokenizer.eos_id

    def scripted(item: Any, logits: np.ndarray) -> Any:
        ids = script(item.seq)
        if ids is not None:
            n = item.seq.num_output_tokens
            want = ids[n] if n < len(ids) else eos
            logits = np.full_like(logits, -1e9)
            logits[want] = 0.0
        return original(item, logits)

    runner._sample = scripted


def reply_ids(engine: Any, text: str) -> list[int]:
    """`text` as the model would write it: markers as their special tokens."""
    return engine.tokenizer.encode(text, add_special=False, parse_special=True)


__all__ = ["script_replies", "reply_ids", "write_think_model", "write_harmony_model"]
