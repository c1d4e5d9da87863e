"""Lowering the quantized-matmul kernels to a GPU's machine code without a GPU: `triton.compile` with
a GPUTarget, as CI checks that the kernels still compile for Hopper (sm_90) on a CPU-only machine, and
the device check reports per kernel. Run it in a process without TRITON_INTERPRET set."""

from __future__ import annotations

import re
from typing import Any

from localllm.backends.torch_backend import triton_quant as tq
from localllm.backends.torch_backend.weights import TYPES

PLANE_TYPES = {"d": "*fp16", "dm": "*fp16", "qs": "*u8", "scm": "*u8", "qh": "*u8", "e": "*u8"}
EXCEPTIONS = {("Q5_0", "qh"): "*i32", ("Q5_1", "qh"): "*i32", ("Q8_0", "qs"): "*i8", ("Q6_K", "scm"): "*i8"}


def _signature(
    kernel: str, qtype: str, config: Any = None
) -> tuple[Any, dict[str, str], dict[str, Any], Any]:
    """(kernel function, argument types, constexprs, launch config) as `gemv`/`gemm` launch it."""
    names = TYPES[qtype][1]
    planes = [EXCEPTIONS.get((qtype, n), PLANE_TYPES[n]) for n in names]
    planes = [planes[0], planes[1], planes[2], planes[2]] if qtype == "Q4_K" else planes
    planes += [planes[0]] * (4 - len(planes))
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", **{f"p{i}": t for i, t in enumerate(planes)}}
    c = config or (tq.GEMV_CONFIGS if kernel == "gemv" else tq.GEMM_CONFIGS)[qtype]
    c = tq.KQUANT_GEMM_2D if kernel == "gemm2d" and config is None else c
    if qtype in tq.KQUANTS:
        return (*_kquant_signature(kernel, qtype, sig, c), c)
    qt = tq.QTYPE_IDS[qtype]
    from localllm.backends.torch_backend import triton_legacy

    del sig["p3"]
    if kernel == "gemv":
        sig.update(N="i32", nb="i32", stride_xm="i32", blocks_per_split="i32")
        consts = dict(QT=qt, BLOCK_N=c.block_n, BLOCK_B=c.step)
        return triton_legacy.gemv_legacy_kernel, sig, consts, c
    sig.update(M="i32", N="i32", nb="i32", stride_xm="i32", blocks_per_split="i32")
    consts = dict(QT=qt, BLOCK_M=16, BLOCK_N=c.block_n, BLOCK_B=c.step, PRECISION="tf32x3")
    return triton_legacy.gemm_legacy_kernel, sig, consts, c


def _kquant_signature(
    kernel: str, qtype: str, sig: dict[str, str], c: Any
) -> tuple[Any, dict[str, str], dict[str, Any]]:
    from localllm.backends.torch_backend import triton_kquant as kq

    kind = tq.KQUANTS[qtype]
    if kernel == "gemv":
        sig.update(N="i32", nb="i32", stride_xm="i32", blocks_per_split="i32")
        return kq.gemv_kquant_kernel, sig, {"KIND": kind, "BLOCK_N": c.block_n, "STEP": c.step}
    sig.update(M="i32", N="i32", nb="i32", stride_xm="i32", blocks_per_split="i32")
    consts = {"KIND": kind, "BLOCK_M": c.block_m or 16, "BLOCK_N": c.block_n, "PRECISION": "tf32x3"}
    if kernel == "gemm2d":
        from localllm.backends.torch_backend import triton_kquant2d

        return triton_kquant2d.gemm_kquant2d_kernel, sig, {**consts, "STEP": c.step}
    return kq.gemm_kquant_kernel, sig, consts


def _source(fn: Any, sig: dict[str, str], consts: dict[str, Any]) -> Any:
    """The kernel as the JIT would specialize it at a launch: pointers 16-byte aligned (torch's
    allocations are), which is what lets Triton widen contiguous loads."""
    import triton

    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, (k, t) in enumerate(full.items())
        if t.startswith("*") or k == "stride_xm"  # x rows: K apart, a multiple of 16 as the JIT sees it
    }
    try:  # Triton >= 3.3: constexprs named in the signature
        return triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts, attrs=aligned)
    except TypeError:  # older: constants apart, no alignment hints
        return triton.compiler.ASTSource(fn=fn, signature=sig, constants=consts)


def lower(arch: int, kernel: str, qtype: str, config: Any = None) -> dict[str, Any]:
    """The compiled kernel's stages by name (ttir, ttgir, llir, ptx, cubin). kernel: "gemv", "gemm",
    or "gemm2d" (the k-quant GEMM of 2-D tiles); config: its launch config, else the default."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn, sig, consts, c = _signature(kernel, qtype, config)
    options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    compiled = triton.compile(_source(fn, sig, consts), target=GPUTarget("cuda", arch, 32), options=options)
    return dict(compiled.asm)


def loop_traffic(asm: dict[str, Any]) -> dict[str, int]:
    """What the main loop spends on moving tiles, from a lowered kernel's stages: in its TTGIR (the
    scf.for body) convert_layout ops and shared-memory buffers written (local_alloc of a value: a
    tile re-laid out through shared memory) and read (local_load); in its PTX (the loop's blocks)
    barriers, shared-memory stores and loads, and all instructions."""
    ttgir, ptx = asm.get("ttgir", ""), asm.get("ptx", "")
    start, end = ttgir.find("scf.for"), ttgir.rfind("scf.yield")
    body = ttgir[start:end] if 0 <= start < end else ""
    out = {
        "convert_layout": body.count("ttg.convert_layout "),
        "local_alloc": len(re.findall(r"ttg\.local_alloc %", body)),
        "local_load": body.count("ttg.local_load "),
    }
    lines = _ptx_loop(ptx)
    for name, op in (("bar_sync", "bar.sync"), ("st_shared", "st.shared"), ("ld_shared", "ld.shared")):
        out[name] = sum(op in line for line in lines)
    out["instructions"] = len(lines)
    return out


def _ptx_loop(ptx: str) -> list[str]:
    """The instructions from the PTX's first loop header to its back branch (its innermost loop)."""
    lines = ptx.splitlines()
    head = next((i for i, line in enumerate(lines) if "Loop Header" in line), None)
    if head is None:
        return []
    label = lines[head].split(":")[0].strip()
    back = [i for i, line in enumerate(lines) if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", line)]
    body = [line.strip() for line in lines[head + 1 : (back[-1] + 1 if back else head + 1)]]
    return [line for line in body if line and not line.startswith(("$", "//", "{", "}", ".loc", ".pragma"))]


def compile_kernels(
    arch: int, which: list[tuple[str, str]], config: Any = None
) -> dict[tuple[str, str], str]:
    """(kernel, type) -> a line on what it became: machine code size, whether tensor-core (mma)
    instructions and 16-byte global loads are in it, its loop's layout traffic; "unsupported: ..."
    where this Triton cannot target the architecture. config: a triton_quant.KernelConfig for all of
    them, else each one's default."""
    out = {}
    for kernel, qtype in which:
        try:
            asm = lower(arch, kernel, qtype, config)
        except (ImportError, NotImplementedError) as e:
            out[kernel, qtype] = f"unsupported: {e}"
            continue
        ptx = asm.get("ptx", "")
        mma = ", mma" if ("mma" in ptx or "wgmma" in ptx) else ""
        wide = ", 16-byte loads" if "ld.global.v4" in ptx else ""
        traffic = " ".join(f"{k}={v}" for k, v in loop_traffic(asm).items())
        out[kernel, qtype] = f"sm_{arch} cubin {len(asm['cubin'])} bytes{mma}{wide}; {traffic}"
    return out
