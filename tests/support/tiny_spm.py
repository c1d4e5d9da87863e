"""A tiny SentencePiece vocabulary (bytes, a few pieces, control and user-defined tokens) as GGUF metadata,
for the tokenizer, convert and checkpoint tests."""

from __future__ import annotations

from localllm.tokenizer.spm import SPACE

UNKNOWN, NORMAL, CONTROL, USER_DEFINED, BYTE = 2, 1, 3, 4, 6


S = SPACE


SPECIALS = [
    ("<unk>", UNKNOWN),
    ("<s>", CONTROL),
    ("</s>", CONTROL),
    ("<turn>", CONTROL),
    ("<tool>", USER_DEFINED),
]


PIECES = [
    (S, -1.0),
    *((c, -2.0) for c in "abcdehlorw"),
    ("he", -3.0),
    ("ll", -3.5),
    ("hell", -4.0),
    ("hello", -4.5),
    (S + "hello", -5.0),
    (S + "w", -6.0),
    ("or", -6.5),
    (S + "wor", -7.0),
    ("ld", -7.5),
    (S + "world", -8.0),
    ("ab", -9.0),
    ("bc", -9.5),
    ("aa", -10.0),
    ("abcd", -1.0),  # abcd: no "abc" piece, never formed
    ("a" + S, -11.0),
    ("a" + S + "b", -12.0),  # a token with a "▁" inside: text may not be cut there
]


def tiny_metadata(pieces: list[tuple[str, float]] = PIECES, **overrides: object) -> dict:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [t for t, _ in SPECIALS] + byte_tokens + [p for p, _ in pieces]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (len(SPECIALS) + 256) + [s for _, s in pieces],
        "tokenizer.ggml.token_type": [k for _, k in SPECIALS] + [BYTE] * 256 + [NORMAL] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}
