"""scripts/device_check.py runs on a machine without a GPU (as CI runs it): a tiny random llama in
Q4_K_M through the torch backend with quantized weights, its memory and decode figures in the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'localllm[torch]')")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"


def test_device_check_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    args = ["--device", "cpu", "--shapes", "tiny", "--skip", "tests,kernels,archs,serve", "--write", "blocks",
            "--weights", "quantized", "--gen", "4", "--work", str(tmp_path), "--json", str(out)]  # fmt: skip
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["item"]: r for r in json.loads(out.read_text())}
    assert "section  item" in run.stdout  # the table at the end
    memory = rows["tiny weights on device"]
    assert "Q4_K" in memory["note"] and "Q6_K" in memory["note"]
    assert float(memory["note"].split("x the file")[0]) <= 1.15
    for item in ("tiny decode, 1 sequence", "tiny decode, 64 sequences"):
        assert float(rows[item]["value"].split()[0]) > 0
    assert rows["device copy"]["value"].endswith("GB/s")
