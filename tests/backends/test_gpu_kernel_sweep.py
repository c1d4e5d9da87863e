"""scripts/gpu_kernel_sweep.py on the CPU (Triton's interpreter): every launch config it would time on a
GPU gives dequantize(w) @ x within float32 rounding, and its JSON names one best config per shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'localllm[torch]')")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_sweep_checks_every_config_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_kernel_sweep.py"),
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    cmd += ["--types", "Q5_1", "Q4_K"]  # a legacy type with qh and mins, a k-quant
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    gemv = [r for r in rows if r["kernel"] == "gemv"]
    assert {r["type"] for r in gemv} == {"Q5_1", "Q4_K"} and all(r["ok"] for r in rows)
    assert len({(r["config"]["block_n"], r["config"]["step"]) for r in gemv}) >= 8  # the configs differ
    assert sum(r["best"] for r in gemv) == 2 and sum(r["default"] for r in gemv) == 2
    assert sum(r["kernel"] == "gemm64" for r in rows) == 2
    # the k-quant's two GEMMs at 64 and 16 rows, the legacy type's per-value one
    kernels = {r["kernel"] for r in rows if r["type"] == "Q4_K"} - {"gemv"}
    assert kernels == {"gemm64", "gemm64-2d", "gemm16", "gemm16-2d"}
    assert {r["kernel"] for r in rows if r["type"] == "Q5_1"} == {"gemv", "gemm64", "gemm64-generic"}
    assert "within float32 rounding" in run.stdout
