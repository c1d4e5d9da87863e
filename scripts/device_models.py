"""Random-weight llamas for scripts/device_check.py, at real models' shapes, in Q4_K_M.

Two ways to get the Q4_K_M file:
- `quantize`: an F16 file of random floats (N(0, 1/sqrt(K)) per matrix), then `localllm quantize
  --type Q4_K_M`: the project's own quantizer, as a user would. Its NumPy K-quant search does about
  0.2-1 M values a second, fine for small shapes, hours for 8B.
- `blocks`: the same tensors, names and metadata, each tensor in the type that `localllm quantize`
  would give it (quant.quantize_gguf.choose_type: Q4_K, with Q6_K for the output and llama.cpp's
  layers of attn_v/ffn_down), filled with random blocks whose scales keep every weight about
  1/sqrt(K) in size. Seconds for 8B: what the device check uses above ~50 M parameters.
Both are valid GGUF files any GGUF reader loads; the weights are noise either way (speed and memory
do not depend on their values).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "support"))


@dataclass(frozen=True)
class LlamaShape:
    name: str
    dim: int
    ffn: int
    n_layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    arch: str = "llama"  # "qwen3": q/k RMS norms per head, rope base 1e6
    head_size: int = 0  # 0: dim // heads (Qwen3 sets it: 32 heads of 128 on a 2,560 hidden size)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of every matrix, in file order."""
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("token_embd.weight", self.vocab, self.dim)]
        out += [] if self.tied else [("output.weight", self.vocab, self.dim)]
        for il in range(self.n_layers):
            for part, rows, cols in (("attn_q", nq, self.dim), ("attn_k", nkv, self.dim),
                                     ("attn_v", nkv, self.dim), ("attn_output", self.dim, nq),
                                     ("ffn_gate", self.ffn, self.dim), ("ffn_up", self.ffn, self.dim),
                                     ("ffn_down", self.dim, self.ffn)):  # fmt: skip
                out.append((f"blk.{il}.{part}.weight", rows, cols))
        return out

    @property
    def params(self) -> int:
        return sum(r * c for _, r, c in self.matrices())


# SmolLM2's vocabulary size (49,152), as the issue's measurements used
SHAPES = {
    "tiny": LlamaShape("tiny", 256, 512, 2, 4, 2, 1024, tied=True),
    "1b": LlamaShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 49152, tied=True),
    "3b": LlamaShape("llama-3.2-3b", 3072, 8192, 28, 24, 8, 49152, tied=True),
    "8b": LlamaShape("llama-3.1-8b", 4096, 14336, 32, 32, 8, 49152, tied=False),
    # the real models' vocabularies (the output projection is 7-13% of their weights)
    "8b-full": LlamaShape("llama-3.1-8b-v128k", 4096, 14336, 32, 32, 8, 128256, tied=False),
    "qwen3-4b": LlamaShape("qwen3-4b", 2560, 9728, 36, 32, 8, 151936, True, "qwen3", 128),
}


def _vocabulary(n: int) -> tuple[list[str], list[int], list[str]]:
    """The tests' byte-level BPE vocabulary, padded with unreachable tokens to n entries."""
    from tiny_model import vocabulary

    tokens, types, merges = vocabulary()
    extra = n - len(tokens)
    return tokens + [f"<|pad{i}|>" for i in range(extra)], types + [1] * extra, merges


def _writer(path: Path, s: LlamaShape):  # type: ignore[no-untyped-def]
    import gguf
    from tiny_model import write_vocabulary

    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_block_count(s.n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    if s.head_size:
        w.add_key_length(s.head_size)
        w.add_value_length(s.head_size)
    w.add_rope_freq_base(1e6 if s.arch == "qwen3" else 500000.0)
    w.add_layer_norm_rms_eps(1e-6 if s.arch == "qwen3" else 1e-5)
    write_vocabulary(w, _vocabulary(s.vocab))
    return w


def _norms(s: LlamaShape) -> list[tuple[str, int]]:
    names = [("output_norm.weight", s.dim)]
    for il in range(s.n_layers):
        names += [(f"blk.{il}.attn_norm.weight", s.dim), (f"blk.{il}.ffn_norm.weight", s.dim)]
        if s.arch == "qwen3":
            names += [(f"blk.{il}.attn_{qk}_norm.weight", s.head_dim) for qk in "qk"]
    return names


def _types(s: LlamaShape) -> dict[str, str]:
    """Each matrix's type in a Q4_K_M file, as `localllm quantize` chooses it."""
    from localllm.quant.quantize_gguf import choose_type, layer_positions

    names = [name for name, _, _ in s.matrices()]
    where = layer_positions(names)
    return {n: choose_type(n, (r, c), "Q4_K_M", s.tied, where.get(n)) for n, r, c in s.matrices()}


# a typical |scale x quant| product per type, so random blocks give weights ~ 1/sqrt(K)
TYPICAL = {"Q4_K": 32 * 8, "Q6_K": 64 * 16, "Q5_0": 8, "Q8_0": 64}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of random `qtype` blocks with scales sized for 1/sqrt(cols) weights."""
    from localllm.quant.ggml import BLOCK_KERNELS

    layout, block_size, _ = BLOCK_KERNELS[qtype]
    n_bytes = rows * (cols // block_size) * layout.itemsize
    raw = np.frombuffer(rng.bytes(n_bytes), dtype=np.uint8).reshape(rows, -1).copy()
    blocks = raw.view(layout)
    scale = np.float16(1.0 / (np.sqrt(cols) * TYPICAL[qtype]))
    for field in ("d", "dmin"):
        if field in layout.names:
            blocks[field] = scale
    return raw


def write_blocks(path: Path, s: LlamaShape, seed: int = 0) -> Path:
    """The Q4_K_M file straight from random blocks (see the module docstring)."""
    import gguf

    rng = np.random.default_rng(seed)
    w, types = _writer(path, s), _types(s)
    for name, n in _norms(s):
        w.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    for name, rows, cols in s.matrices():
        qt = gguf.GGMLQuantizationType[types[name]]
        nbytes = rows * cols // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1]
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), nbytes, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, n in _norms(s):
        w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    for name, rows, cols in s.matrices():
        w.write_tensor_data(random_blocks(types[name], rows, cols, rng))
    w.close()
    return path


def write_f16(path: Path, s: LlamaShape, seed: int = 0) -> Path:
    """Random floats as F16 (the input `localllm quantize` takes)."""
    rng = np.random.default_rng(seed)
    w = _writer(path, s)
    for name, n in _norms(s):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    for name, rows, cols in s.matrices():
        w.add_tensor(name, (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_q4_k_m(folder: Path, s: LlamaShape, how: str = "auto") -> tuple[Path, str]:
    """(the Q4_K_M file, how it was made): `quantize` below ~50 M parameters or when asked."""
    how = how if how != "auto" else ("quantize" if s.params < 50_000_000 else "blocks")
    out = folder / f"{s.name}-Q4_K_M.gguf"
    if out.exists():
        return out, how + " (cached)"
    if how == "blocks":
        return write_blocks(out, s), how
    f16 = write_f16(folder / f"{s.name}-F16.gguf", s)
    cmd = [sys.executable, "-m", "localllm", "quantize", str(f16), str(out), "--type", "Q4_K_M"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    f16.unlink()
    return out, "localllm quantize"
