"""A fresh process's first requests load no kernel: the Numba backend's warm-up covers every launcher a
step may take at either thread count the governor picks (a restarted server's first prompt, restored
from the disk tier, loaded the serial int16 output-projection launcher: ~30 ms of its TTFT)."""

from __future__ import annotations

import json
import subprocess
import sys

import numba
import pytest
from paths import SUPPORT


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs Numba to start two threads")
def test_a_first_request_loads_no_kernel_at_either_thread_count(tiny_model_path) -> None:
    child = SUPPORT / "warm_start_child.py"
    out = subprocess.run(
        [sys.executable, str(child), str(tiny_model_path), "2"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
