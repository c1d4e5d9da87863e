"""AVX-VNNI (256-bit `vpdpbusd`, VEX-encoded: Intel laptops since Alder Lake) is what the
*_avxvnni kernels become on such a CPU.  No such CPU is needed here: the kernels' LLVM IR is built
directly and compiled for LLVM's `alderlake`, which has AVX-VNNI and no AVX-512; every dot product
must come out as a VEX `vpdpbusd` on ymm registers, with no AVX2 pair left and no zmm.
(Their sums are compared with numpy's in test_kernels.py wherever the host runs them.)"""

from __future__ import annotations

import re

import pytest
from llvmlite import ir

from localllm.kernels import simd_x86, simd_x86_quads

llvm = pytest.importorskip("llvmlite.binding")

_i64 = ir.IntType(64)


def _assembly(body, name: str) -> str:
    """One function `name(i64, i64, i64, i64)` whose body is written by body(builder, args), compiled
    for alderlake: its assembly."""
    module = ir.Module(name=name)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_i64] * 4), name)
    builder = ir.IRBuilder(fn.append_basic_block())
    body(builder, list(fn.args))
    builder.ret_void()
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        target = llvm.Target.from_triple("x86_64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this llvmlite has no x86 target")
    machine = target.create_target_machine(cpu="alderlake", features="", opt=3)
    parsed = llvm.parse_assembly(str(module))
    parsed.triple = "x86_64-unknown-linux-gnu"
    return machine.emit_assembly(parsed)


KERNELS = {  # name -> (IR writer, the VNNI instruction, how many per 32-block)
    "quad_sums": (lambda b, a: simd_x86_quads.quad_sums_vnni(b, a, False), "vpdpbusd", 64),
    "quad_sums_split": (lambda b, a: simd_x86_quads.quad_sums_vnni(b, a, True), "vpdpbusd", 64),
    "q8_block_sums": (lambda b, a: simd_x86._q8_block_sums(b, a, True), "vpdpbusd", 64),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_avx_vnni_kernels_compile_to_vex_vpdpbusd_for_alder_lake(name: str) -> None:
    body, op, count = KERNELS[name]
    asm = _assembly(body, name)
    vex = re.findall(rf"\{{vex\}}\s+{op}\s+%ymm\d+, %ymm\d+, %ymm\d+", asm)
    assert len(vex) == count, asm[-3000:]
    assert "zmm" not in asm
    assert not re.search(r"\bvpmaddubsw\b|\bvpmaddwd\b", asm)
