"""A base model's log-probabilities, saved for KL-divergence runs: llama-perplexity's `_logits_` format.

Layout (little-endian): the magic `_logits_`, uint32 n_ctx, int32 n_vocab, int32 n_chunk, the text's
n_chunk * n_ctx tokens (int32, as tokenized: a chunk's first token is not replaced by BOS), then for
each chunk one row per scored position (n_ctx - 1 - n_ctx/2 of them) of nv = 2*ceil(n_vocab/2) + 4
uint16: two float32 (scale, min_log_prob) and the log-probabilities quantized to 16 bits over the 16
nats below the largest (entries further down store 0 and count as "negligible").

So a row costs ~2 bytes per vocabulary entry (Qwen2.5's 151,936: 297 KiB; 255 rows a 512-token chunk:
76 MiB), the log-probabilities keep ~2.4e-4 nats of resolution, and files are interchangeable with
llama.cpp's (`llama-perplexity --kl-divergence-base`).  Rows are written and read one chunk at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from localllm.errors import LocalLLMError
from localllm.partial_file import open_locked, part_path, remove_stale

MAGIC = b"_logits_"
_RANGE = np.float32(16.0)  # nats below the top kept; llama.cpp's choice


def row_width(n_vocab: int) -> int:
    """uint16 per stored row: 4 for the two float32 header values, the vocabulary padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_rows(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """float logits (rows, n_vocab) -> (rows, row_width) uint16 rows, as llama.cpp's log_softmax."""
    logits = np.asarray(logits, dtype=np.float32)
    rows, n_vocab = logits.shape
    top = logits.max(axis=1, keepdims=True)
    low = np.maximum(logits.min(axis=1, keepdims=True), top - _RANGE)
    log_sum = np.log(np.exp(logits - top).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    scale = (top - low) / np.float32(65535.0)
    out = np.zeros((rows, row_width(n_vocab)), dtype=np.uint16)
    header = np.concatenate([scale, low - top - log_sum], axis=1).astype("<f4")
    out[:, :4] = header.view(np.uint16)
    inv = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint(inv * (logits - low))  # ties to even, as ggml's nearest_int
    out[:, 4 : 4 + n_vocab] = np.where(logits > low, q, 0).astype(np.uint16)
    return out


def dequantize_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """(rows, row_width) uint16 -> float32 log-probabilities (rows, n_vocab)."""
    header = np.ascontiguousarray(rows[:, :4]).view("<f4")
    scale, low = header[:, :1], header[:, 1:2]
    return scale * rows[:, 4 : 4 + n_vocab].astype(np.float32) + low


class LogitsWriter:
    """Writes a `_logits_` file under a temporary name; `commit` renames it into place."""

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, tokens: np.ndarray, n_chunk: int) -> None:
        self.path = Path(path)
        self.tmp = part_path(self.path)
        self.n_vocab = n_vocab
        try:
            remove_stale(self.path)  # what a killed run left
            self.file: BinaryIO = open_locked(self.tmp)  # closed in commit/discard
        except OSError as e:
            raise LocalLLMError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.file.write(MAGIC)
        self.file.write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        self.file.write(np.asarray(tokens[: n_chunk * n_ctx], dtype="<i4").tobytes())

    def add_chunk(self, logits: np.ndarray) -> None:
        self.file.write(quantize_log_probs(logits).astype("<u2").tobytes())

    def commit(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class LogitsReader:
    """Reads a `_logits_` file: its header and tokens at once, the rows one chunk at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (closed in close)
        except OSError as e:
            raise LocalLLMError(f"cannot read {path}: {e.strerror or e}") from None
        if self.file.read(8) != MAGIC:
            self.close()
            raise LocalLLMError(f"{path} is not a logits file (made by --save-logits)")
        header = np.frombuffer(self._read(12, "header"), dtype="<i4")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(v) for v in header)
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            self.close()
            raise LocalLLMError(f"{path}: bad header (n_ctx {self.n_ctx}, n_vocab {self.n_vocab})")
        count = self.n_chunk * self.n_ctx
        self.tokens = np.frombuffer(self._read(4 * count, "tokens"), dtype="<i4").astype(np.int64)

    def _read(self, n: int, what: str) -> bytes:
        data = self.file.read(n)
        if len(data) != n:
            self.close()
            raise LocalLLMError(f"{self.path} is truncated (in its {what})")
        return data

    def chunk_tokens(self, i: int) -> list[int]:
        return self.tokens[i * self.n_ctx : (i + 1) * self.n_ctx].tolist()

    def next_chunk(self) -> np.ndarray:
        """The next chunk's stored rows, (scored_rows(n_ctx), row_width(n_vocab)) uint16."""
        shape = (scored_rows(self.n_ctx), row_width(self.n_vocab))
        data = self._read(2 * shape[0] * shape[1], "log-probabilities")
        return np.frombuffer(data, dtype="<u2").reshape(shape)

    def close(self) -> None:
        self.file.close()
