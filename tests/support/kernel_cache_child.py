"""Child process of test_kernel_cache.py: integer matmuls of each tile kernel, and a whole model's
logits (a Q4_K_M qwen2: the fused stack, the attention and the precise output projection; a prefill and
decode steps), saved bit for bit.

Run as `python kernel_cache_child.py OUT.npz DIR` with NUMBA_CACHE_DIR set: the kernels are compiled
afresh into an empty cache dir, or loaded from a warm one, and the two runs must agree exactly. DIR
holds the model file (written by the first run, read by the second).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from random_weights import random_weight

from localllm.kernels import matmul
from localllm.kernels.act_rounding import ROUND_Q8_0
from localllm.kernels.quantize_act import quantize_rows

# One kind per tile kernel and high-bit variant: tile_nibbles (4-bit, 5-bit), tile_q6_k, tile_q8_0.
KINDS = ("Q4_1", "Q5_0", "Q6_K", "Q8_0")
# A lone row, the direct kernel's chunk, a chunk unpacked once for many rows, and several chunks.
ROWS = (1, 3, 16, 21, 40)


def outputs() -> dict[str, np.ndarray]:
    out = {}
    for name in KINDS:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        w = matmul.prepare_weight(random_weight(rng, name, 136, 512), T[name])
        for t in ROWS:
            x = (rng.standard_normal((t, 512)) * 4).astype(np.float32)
            for nth in (1, 2):  # the serial and the parallel launcher
                out[f"{name}-{t}-{nth}"] = matmul.linear(x, w, nth=nth)
    x = (np.random.default_rng(0).standard_normal((5, 512)) * 4).astype(np.float32)
    for i, a in enumerate(quantize_rows(x, ROUND_Q8_0)):
        out[f"quantize_rows-{i}"] = a
    return out


def model_file(folder: Path) -> Path:
    """A 4-layer qwen2 at dim 256 (K-quant blocks), Q4_K_M by localllm's quantizer: Q4_K, Q6_K rows."""
    from tiny_arch import Shape, write_arch_model

    from localllm.quant.quantize_gguf import quantize_file

    path = folder / "qwen2-Q4_K_M.gguf"
    if not path.exists():
        shape = Shape(256, 512, head_dim=64)
        src = write_arch_model(folder / "qwen2-f32.gguf", "qwen2", "F32", n_layers=4, shape=shape)
        quantize_file(src, path, "Q4_K_M")
    return path


def model_outputs(folder: Path) -> dict[str, np.ndarray]:
    """A 40-token prefill's logits at every position, then greedy decode steps' logits, at 1 and 2 threads."""
    from localllm.engine.engine import EngineConfig, LLMEngine, score_tokens
    from localllm.sampling_params import SamplingParams

    out = {}
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]
    for nth in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(model_file(folder)), threads=nth))
        out[f"model-prefill-{nth}"] = np.asarray(score_tokens(engine, prompt))
        steps = []
        engine.runner.model.forward = _recording(engine.runner.model.forward, steps)
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        out[f"model-decode-{nth}"] = np.concatenate(steps)
        engine.close()
    return out


def _recording(forward, steps: list):
    def recorded(batch, kv):
        logits = forward(batch, kv)
        steps.append(np.array(logits, copy=True))
        return logits

    return recorded


if __name__ == "__main__":
    np.savez(sys.argv[1], **outputs(), **model_outputs(Path(sys.argv[2])))
