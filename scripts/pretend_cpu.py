"""Run the localllm CLI as if this x86 CPU were a smaller one: LLVM is told that AVX-512 (`avx2`: the AVX2
kernels run) or also AVX2/FMA/F16C (`portable`: the loops ARM laptops run) are missing before the kernels
import, and compiles for a matching CPU, with its own Numba cache.  `avx2-vnni` is an AVX2 laptop with
AVX-VNNI (Intel since Alder Lake): on a host with AVX512-VNNI it keeps AVX512F/VL/VNNI (so the 256-bit
`vpdpbusd` runs, EVEX-encoded) and drops the rest of AVX-512, with LLVM told to prefer 256-bit vectors.
How the AVX2 figures of docs/benchmarks.md are taken on an AVX-512 machine, beside llama.cpp built for
AVX2 only:

    python scripts/pretend_cpu.py avx2 bench -m MODEL -p 128 -n 32 -t 1,2 --llama-bench LLAMA_AVX2/llama-bench
    python scripts/pretend_cpu.py avx2 scripts/profile_decode_step.py MODEL -t 1,2 -n 24

The memory and cores are still this machine's: only the instructions (and LLVM's tuning) are the smaller
CPU's.  (tests/support/fake_cpu_child.py checks the same kernels' bits.)
"""

from __future__ import annotations

import os
import sys
import tempfile

# -> the CPU LLVM compiles for: AVX2 keeps this machine's name (its tuning and its prefetch rule, which
# belong to the memory system; kernels/simd_x86.SOFTWARE_PREFETCH), less the features dropped.
LEVELS = {"avx2": None, "avx2-vnni": None, "portable": "x86-64"}
# AVX-512 features the avx2-vnni level keeps where the host has no AVX-VNNI (VEX) of its own.
VNNI256_EVEX = ("avx512f", "avx512vl", "avx512vnni")
# The VEX extensions of AVX2 laptops since Alder Lake (AVX-VNNI and its kin), which AMD Zen 5 also
# reports: a plain AVX2 CPU (Haswell to Zen 3) has none of them.
_AVX2_EXTRAS = ("avxvnni", "avxvnniint8", "avxvnniint16", "avxifma", "avxneconvert")


def pretend(level: str) -> None:
    """Set up the pretence; call before anything imports numba."""
    import llvmlite.binding as llvm

    os.environ["NUMBA_CPU_NAME"] = LEVELS[level] or llvm.get_host_cpu_name()
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"localllm-numba-{level}"))
    drop_features(level)


def drop_features(level: str) -> None:
    """Make llvmlite report the host's CPU features less those `level` lacks (the CPU name and Numba's
    cache are the caller's: tests/support/fake_cpu_child.py sets its own)."""
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_features

    def features() -> object:
        f = host()
        keep = VNNI256_EVEX if level == "avx2-vnni" and not f.get("avxvnni", False) else ()
        if keep and not all(f.get(name, False) for name in keep):
            sys.exit("avx2-vnni: this CPU has neither AVX-VNNI nor AVX512-VNNI")
        for name in list(f):
            if name.startswith("avx512") and name not in keep:
                f[name] = False
            elif name in _AVX2_EXTRAS and level != "avx2-vnni":
                f[name] = False
            elif level == "portable" and name in ("avx2", "fma", "f16c", "avx"):
                f[name] = False
        if keep:
            f["prefer-256-bit"] = True
        return f

    llvm.get_host_cpu_features = features


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in LEVELS:
        sys.exit(f"usage: pretend_cpu.py {{{','.join(LEVELS)}}} (LOCALLLM-ARGS... | SCRIPT.py ARGS...)")
    pretend(sys.argv[1])
    if sys.argv[2].endswith(".py"):  # another script of this folder, e.g. profile_decode_step.py
        import runpy

        sys.argv = sys.argv[2:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    from localllm.cli import main as cli

    sys.argv = ["localllm", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()
