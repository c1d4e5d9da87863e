"""The kernels on CPUs this machine is not: AVX2 without AVX-512 (with and without AVX-VNNI), and no
AVX2 at all (ARM laptops and old x86 take the portable loops).  A child process pretends the features
are missing and compiles for a matching target; rows must give the same bits whatever their batch, and
no instruction the pretend CPU lacks may be compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import llvmlite.binding as llvm
import pytest
from paths import SUPPORT

from localllm.kernels.simd_x86 import HAVE_AVX2, HAVE_VNNI256

CHILD = SUPPORT / "fake_cpu_child.py"


# the feature dropped -> the LLVM CPU compiled for ("aarch64": the portable kernels, retargeted)
# ("avx512-but-vnni": this CPU's own name, whose VNNI the child keeps: a VNNI-era name such as alderlake
# would also turn on instructions this CPU may lack)
CPUS = {"avx512": "haswell", "avx512-but-vnni": llvm.get_host_cpu_name()}
CPUS.update({"avx2": "x86-64", "aarch64": "x86-64"})
FAMILIES = {"avx512": "avx2", "avx512-but-vnni": "avx2-vnni", "avx2": "portable"}


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[str]]:
    """The child's output lines with `drop` missing, one run per drop for the module's tests."""
    runs: dict[str, list[str]] = {}

    def run(drop: str) -> list[str]:
        if drop not in runs:
            cache = tmp_path_factory.mktemp(f"numba-{drop}")
            env = {**os.environ, "NUMBA_CPU_NAME": CPUS[drop], "NUMBA_CACHE_DIR": str(cache)}
            if drop == "aarch64":
                env["NUMBA_OPT"] = "0"  # see fake_cpu_child.aarch64_check
            env["PYTHONPATH"] = os.pathsep.join([str(CHILD.parent), env.get("PYTHONPATH", "")])
            out = subprocess.run(
                [sys.executable, str(CHILD), drop], env=env, capture_output=True, text=True, timeout=900
            )
            assert out.returncode == 0, out.stderr[-3000:]
            runs[drop] = out.stdout.splitlines()
        return runs[drop]

    return run


@pytest.mark.skipif(not HAVE_AVX2, reason="pretends to be a smaller x86 CPU than an AVX2 one")
@pytest.mark.parametrize("drop", ["avx512", "avx512-but-vnni", "avx2"])
def test_rows_do_not_depend_on_their_batch_on_smaller_cpus(child: Callable, drop: str) -> None:
    if drop == "avx512-but-vnni" and not HAVE_VNNI256:
        pytest.skip("needs a CPU with a 256-bit VNNI")
    lines = child(drop)
    assert lines[0] == f"avx2={drop != 'avx2'} avx512=False kernels={FAMILIES[drop]}"
    assert lines[1:6] == [f"{name} same" for name in ("Q4_0", "Q5_0", "Q4_K", "Q6_K", "Q8_0")]


@pytest.mark.skipif(not HAVE_AVX2, reason="pretends to be a smaller x86 CPU than an AVX2 one")
def test_portable_kernels_compile_for_aarch64(child: Callable) -> None:
    """ARM laptops run the portable kernels: compiled on an x86 CPU without AVX, retargeted to aarch64,
    they must hold no x86 intrinsic and LLVM's AArch64 backend must emit them (skipped where llvmlite
    lacks that target)."""
    lines = child("aarch64")
    if lines[-1] == "aarch64 unavailable":
        pytest.skip("this llvmlite has no AArch64 target")
    assert lines == ["avx2=False avx512=False kernels=portable", "aarch64 11 kernels"]
