"""The kernels on CPUs this machine is not: AVX2 without AVX-512, and no AVX2 at all (ARM laptops and
old x86 take the portable loops).  A child process pretends the features are missing and compiles for
a matching target; rows must give the same bits whatever their batch, and no instruction the pretend
CPU lacks may be compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import SUPPORT

from localllm.kernels.simd_x86 import HAVE_AVX2

CHILD = SUPPORT / "fake_cpu_child.py"


@pytest.mark.skipif(not HAVE_AVX2, reason="pretends to be a smaller x86 CPU than an AVX2 one")
@pytest.mark.parametrize(("drop", "cpu"), [("avx512", "haswell"), ("avx2", "x86-64")])
def test_rows_do_not_depend_on_their_batch_on_smaller_cpus(tmp_path: Path, drop: str, cpu: str) -> None:
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(CHILD.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(CHILD), drop], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == ("avx2=True avx512=False" if drop == "avx512" else "avx2=False avx512=False")
    assert lines[1:] == [f"{name} same" for name in ("Q4_0", "Q5_0", "Q4_K", "Q6_K", "Q8_0")]
