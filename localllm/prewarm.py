"""A machine's first run compiles the kernels while the model downloads, instead of after.

The fused layer stack, the attention and norm kernels and the launchers do not depend on the model's
weights, and the per-type matmul kernels depend only on the weights' quantization types, which a
registry entry's file name states (`...Q4_1.gguf`, `...q4_k_m.gguf`). So while pip fetches the model, a
thread builds a small random model of those types and loads it exactly as the real one will load:
everything the real model needs is then in Numba's on-disk cache when the download ends. Nothing here
is needed for correctness: if it fails, the real load compiles what is missing as it always did.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from localllm.model_entry import ModelEntry, TensorTypes

log = logging.getLogger("localllm")

# A type named in a GGUF file name (a registry entry may say exactly: `tensor_types`).
_TYPE_IN_NAME = re.compile(r"(?i)(?:^|[._-])(q[2-8]_(?:[01]|k)(?:_[sml])?|bf16|f16|f32)(?=[._-])")
_WRITABLE = {"F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tensor_types(entry: ModelEntry | None, file_name: str) -> TensorTypes | None:
    """The types a model file holds: its registry entry's, else a guess from its name (a K-quant mix
    such as Q4_K_M keeps some tensors at Q6_K), else None (nothing to compile ahead)."""
    from localllm.model_entry import TensorTypes

    if entry is not None and entry.tensor_types is not None:
        return entry.tensor_types
    m = _TYPE_IN_NAME.search(file_name)
    if m is None:
        return None
    name = m.group(1).upper()
    main, mix = (name[:4], True) if name.count("_") == 2 else (name, False)
    if main not in _WRITABLE:
        return None
    return TensorTypes(main, (main, "Q6_K") if mix else (main,), "Q6_K" if mix else None)


def write_synthetic_model(path: Path, types: TensorTypes) -> Path:
    """A 2-layer random llama holding `types` in their roles; 256 wide, so every block size divides its
    rows. Types we cannot write (Q2_K, Q3_K, BF16) are left out: the real load compiles those."""
    import gguf

    from localllm.quant.quantize_gguf import convert_rows

    dim, ffn, vocab = 256, 512, 512
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (w.add_block_count, 2), (w.add_context_length, 256), (w.add_embedding_length, dim),
        (w.add_feed_forward_length, ffn), (w.add_head_count, 4), (w.add_head_count_kv, 2),
        (w.add_rope_dimension_count, 64), (w.add_layer_norm_rms_eps, 1e-5),
    ):  # fmt: skip
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        kind = kind if kind in _WRITABLE else "F32"
        data = convert_rows(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind)
        raw = None if kind in ("F32", "F16") else getattr(gguf.GGMLQuantizationType, kind)
        w.add_tensor(name, data, raw_dtype=raw)

    def vector(name: str) -> None:
        w.add_tensor(name, np.ones(dim, np.float32))

    matrix("token_embd.weight", vocab, dim, types.token_embd)
    if types.output is not None:
        matrix("output.weight", vocab, dim, types.output)
    vector("output_norm.weight")
    shapes = {"attn_k": (128, dim), "attn_v": (128, dim), "ffn_gate": (ffn, dim), "ffn_up": (ffn, dim)}
    shapes["ffn_down"] = (dim, ffn)
    for i in range(2 * len(_LAYER_MATRICES)):  # every layer type at least once (up to 14 types)
        il, j = divmod(i, len(_LAYER_MATRICES))
        name = _LAYER_MATRICES[j]
        rows, cols = shapes.get(name, (dim, dim))
        matrix(f"blk.{il}.{name}.weight", rows, cols, types.layers[i % len(types.layers)])
    for il in range(2):
        vector(f"blk.{il}.attn_norm.weight")
        vector(f"blk.{il}.ffn_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class KernelPrewarm:
    """Compiles, on a thread, what a model of `types` will need, for `threads` threads and a KV cache
    of `cache_types`. start() it before a download, join() it after."""

    def __init__(self, types: TensorTypes, threads: int, cache_types: tuple[str, str]):
        self.types, self.threads, self.cache_types = types, threads, cache_types
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="localllm-prewarm", daemon=True)

    def start(self) -> KernelPrewarm:
        self._thread.start()
        return self

    def join(self) -> float | None:
        """Waits for the compile; its duration, or None if it failed (the real load compiles then)."""
        self._thread.join()
        return self.seconds

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._compile()
        except Exception as e:  # noqa: BLE001 (an optimisation only: the real load compiles anyway)
            log.debug("kernel prewarm failed: %s", e)
            return
        self.seconds = time.perf_counter() - start

    def _compile(self) -> None:
        from localllm.backends import make_backend
        from localllm.loading.file import GGUFFile
        from localllm.models import load_model

        with tempfile.TemporaryDirectory(prefix="localllm-prewarm-") as tmp:
            path = write_synthetic_model(Path(tmp) / "prewarm.gguf", self.types)
            backend = make_backend("numba", self.threads)
            model = load_model(GGUFFile.open(path), backend)
            backend.warmup(model, self.cache_types)
