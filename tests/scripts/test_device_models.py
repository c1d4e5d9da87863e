"""scripts/device_models.py's random Q4_K_M writer at a Qwen3 shape (heads wider than hidden / heads,
q/k norms): the file has Qwen3's tensors and head size, and localllm runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from device_models import LlamaShape, write_blocks  # noqa: E402


def test_qwen3_shape_writes_a_file_localllm_runs(tmp_path: Path) -> None:
    import gguf
    from arch_conformance import engine

    from localllm.engine.engine import score_tokens

    shape = LlamaShape("tiny-qwen3", 256, 512, 2, 4, 2, 1024, True, "qwen3", 128)
    path = write_blocks(tmp_path / "q.gguf", shape)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen3"
    assert r.fields["qwen3.attention.key_length"].contents() == 128
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.1.attn_k_norm.weight"].n_elements == 128
    assert tuple(tensors["blk.0.attn_q.weight"].shape) == (256, 4 * 128)  # gguf order: (cols, rows)
    assert tensors["blk.0.ffn_gate.weight"].tensor_type.name == "Q4_K"
    logits = np.asarray(score_tokens(engine(path, "numpy"), [5, 6, 7]), np.float32)
    assert logits.shape == (3, 1024) and np.isfinite(logits).all()
