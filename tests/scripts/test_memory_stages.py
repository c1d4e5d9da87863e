"""scripts/memory_stages.py: the staged resident memory of a `run` on the tiny model, as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "memory_stages.py"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self (Linux)")
def test_memory_stages_of_a_tiny_run(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    args = [str(tiny_model_path), "-c", "64", "-t", "1", "-n", "2", "--words", "8", "--json", str(out)]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["stage"] for r in rows] == ["start", "localllm imported", "engine loaded", "after the run"]
    peaks = [r["VmHWM"] for r in rows]
    assert peaks == sorted(peaks) and peaks[0] > 0  # the high-water mark never falls
    loaded = rows[2]
    assert loaded["VmRSS"] > rows[1]["VmRSS"]  # Numba, the kernels and the weights came in
    assert any(name == "libllvmlite.so" for name, _ in loaded["largest"])
    assert "| engine loaded |" in run.stdout
