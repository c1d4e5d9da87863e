"""Child process for tests/kernels/test_fake_cpu.py: pretend the CPU lacks AVX-512 (argv[1] == "avx512";
"avx512-but-vnni": keeps the 256-bit VNNI, an AVX-VNNI laptop) or also AVX2/FMA/F16C (argv[1] == "avx2")
before the kernels import, compile for a matching target
(NUMBA_CPU_NAME is set by the parent), and check that every activation row gives the same bits alone,
in small groups and among 21 rows, for linear and linear_precise.  A kernel that used an instruction
the pretend CPU lacks would stop LLVM here.  Prints one line per weight type; with AVX2 dropped (the
portable kernels ARM runs).  argv[1] == "aarch64" drops AVX2 too but only checks that the portable
kernels compile for an aarch64 target."""

from __future__ import annotations

import sys
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np

DROP = sys.argv[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from pretend_cpu import drop_features  # noqa: E402

# the level left when DROP is missing
drop_features({"avx512": "avx2", "avx512-but-vnni": "avx2-vnni"}.get(DROP, "portable"))

from random_weights import random_weight  # noqa: E402

from localllm.backends.numba_cpu import NumbaBackend  # noqa: E402
from localllm.kernels import matmul_int, simd_x86, simd_x512  # noqa: E402

TYPES = {"Q4_0": 2, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14, "Q8_0": 8}
GROUPS = ((0, 1), (3, 2), (3, 5), (2, 16))


def main() -> None:
    print(f"avx2={simd_x86.HAVE_AVX2} avx512={simd_x512.HAVE_AVX512} kernels={matmul_int.KERNEL_FAMILY}")
    if DROP == "aarch64":
        print(aarch64_check())
        return
    rng = np.random.default_rng(0)
    backend = NumbaBackend(threads=2)
    for name, ggml_type in TYPES.items():
        raw = random_weight(rng, name, 70, 256)
        w = backend.prepare_weight(raw, ggml_type)
        x = rng.standard_normal((21, 256)).astype(np.float32)
        same = []
        for op in (backend.linear, backend.linear_precise):
            together = op(x, w)
            same.append(all(np.array_equal(op(x[i : i + r], w), together[i : i + r]) for i, r in GROUPS))
        print(name, "same" if all(same) else "DIFFERENT")


def aarch64_check() -> str:
    """The portable range kernels of the five types, compiled without Numba's optimisation (NUMBA_OPT=0:
    LLVM's x86 passes would put x86 forms in, e.g. of the refcount atomics) and retargeted to 64-bit ARM:
    no x86 intrinsic may remain and LLVM's AArch64 backend must emit them.  One line: 'aarch64 N
    kernels', or why not."""
    import re

    from localllm.kernels import matmul

    try:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        target = llvm.Target.from_triple("aarch64-unknown-linux-gnu")
    except RuntimeError:
        return "aarch64 unavailable"
    machine = target.create_target_machine(cpu="generic", features="+neon", opt=2)
    kernels = [matmul.range_kernel(t, path) for t in (0, 2, 5, 7, 4) for path in ("int", "float")]
    kernels.append(matmul.range_kernel(4, "int16"))
    for kernel in kernels:
        ir = kernel.inspect_llvm()
        x86 = sorted(set(re.findall(r"@llvm\.x86\.[\w.]+", ir)))
        if x86:
            return f"aarch64 x86 intrinsics: {x86}"
        module = llvm.parse_assembly(ir)
        module.triple, module.data_layout = "aarch64-unknown-linux-gnu", str(machine.target_data)
        if len(machine.emit_object(module)) == 0:
            return "aarch64 empty object"
    return f"aarch64 {len(kernels)} kernels"


if __name__ == "__main__":
    main()
