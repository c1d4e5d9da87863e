"""Sweep the Triton decode GEMV's launch configs per quantized type and shape; one table at the end.

    python scripts/gpu_kernel_sweep.py                  # CUDA: 3 shapes x 8 types, ~4-5 configs each
    python scripts/gpu_kernel_sweep.py --json sweep.json
    python scripts/gpu_kernel_sweep.py --device cpu     # Triton's interpreter, tiny shapes: results only

On CUDA each (type, shape, config, programs target) GEMV with one x row is timed in a CUDA graph of
REPS launches (no launch gaps), cycling over copies of the weight that together exceed 3x the L2 cache
(so every launch reads its weight from HBM), after a warm-up; GB/s is the weight's bytes over the
time, beside its share of a measured device copy (read + write). The best per (type, shape) is marked;
the 64-row GEMM is timed with its default config (k-quants: also the 2-D-tile kernel, and both at 16
rows). Each GEMV's result is checked against torch's
dequantization (weights.dequantize_torch) times x. On the CPU nothing is timed: every config's result
is checked the same way (within float32 rounding), which is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CUDA_SHAPES = [(8192, 8192), (2048, 8192), (14336, 4096)]  # (N, K)
CPU_SHAPES = [(24, 512)]
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# compiled configs (block_n, step, num_warps, num_stages), each timed at every programs target (a
# launch-time choice: no compile), beside the type's default (triton_quant.GEMV_CONFIGS). No stages:
# Triton does not software-pipeline these loops (the same PTX at 1 and 3), so they would only compile.
LEGACY = [(64, 8, 4, 1), (32, 8, 4, 1), (16, 16, 4, 1), (32, 16, 4, 1), (128, 8, 8, 1)]
KQUANT = [(32, 2, 4, 1), (16, 4, 4, 1), (32, 4, 4, 1), (16, 2, 4, 1), (64, 2, 8, 1)]
PROGRAMS = [512, 1024, 2048, 4096]
REPS = 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--grid", choices=["full", "small"], default="full", help="small: 3 configs a type")
    p.add_argument(
        "--jobs", type=int, default=6, help="CUDA: processes that compile the kernels first (0: none)"
    )
    p.add_argument("--warm-part", help=argparse.SUPPRESS)  # "i/n": a compiling worker's share
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch

    start = time.perf_counter()
    device = torch.device(args.device)
    if args.warm_part:
        return warm(args.types, args.grid == "small", *map(int, args.warm_part.split("/")))
    if args.device == "cuda" and args.jobs > 0:
        compile_first(args)
    copy = copy_bandwidth() if args.device == "cuda" else 0.0
    rows: list[dict[str, Any]] = []
    for qtype in args.types:
        for n, k in CUDA_SHAPES if args.device == "cuda" else CPU_SHAPES:
            rows += sweep_one(qtype, n, k, device, copy, args.grid == "small")
    mark_best(rows)
    print_table(rows, copy, time.perf_counter() - start)
    if args.json:
        args.json.write_text(json.dumps({"copy_gbps": copy / 1e9, "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print("WRONG RESULT:", r, file=sys.stderr)
    return 1 if bad else 0


def compile_first(args: argparse.Namespace) -> None:
    """Compile every kernel the sweep launches in `jobs` processes at once, into Triton's on-disk cache
    (the shapes below specialize as the real ones do: every size a multiple of 16), so this process
    loads them instead of compiling one at a time. Best effort: a worker that fails costs nothing."""
    import subprocess

    begin = time.perf_counter()
    base = [sys.executable, __file__, "--types", *args.types, "--grid", args.grid]
    procs = [subprocess.Popen([*base, "--warm-part", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
    failed = sum(p.wait() != 0 for p in procs)
    print(
        f"compiled in {args.jobs} processes: {time.perf_counter() - begin:.0f} s ({failed} failed)",
        flush=True,
    )


def warm(types: list[str], small: bool, part: int, parts: int) -> int:
    """Launch this worker's share of the kernels once, on small weights."""
    import torch

    from localllm.backends.torch_backend import triton_quant as tq

    jobs = [(t, "gemv", c) for t in types for c in dict.fromkeys(_compiled(c) for c in configs(t, small))]
    jobs += [(t, kind, None) for t in types for kind in _gemm_kinds(t)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x1, x64 = torch.randn(1, 4096, device=device), torch.randn(64, 4096, device=device)
    for qtype, kind, c in jobs[part::parts]:
        w = random_weight(qtype, 64, 4096, device)
        if kind == "gemv":
            tq.gemv(x1, w, config=c)
        else:
            tq.gemm(x64, w, generic=kind == "generic", config=tq.KQUANT_GEMM_2D if kind == "2d" else None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"  compiled {len(jobs[part::parts])} kernels", flush=True)
    return 0


def _compiled(c: Any) -> Any:
    """c with the programs target left at its default: what a compile depends on."""
    from dataclasses import replace

    from localllm.backends.torch_backend import triton_quant as tq

    return replace(c, programs=tq.KernelConfig(1, 1).programs)


def copy_bandwidth() -> float:
    """Bytes per second a device copy moves (read + write), over 1 GiB."""
    import torch

    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _seconds(lambda: b.copy_(a), reps=REPS)


def random_weight(qtype: str, n: int, k: int, device: Any, seed: int = 0) -> Any:
    """A QuantWeight of random planes, made on the device: planes shaped as weights.repack makes them,
    fp16 scales in +-0.02, K-quant 6-bit scales below 64, any other bits random."""
    import numpy as np
    import torch

    from localllm.backends.torch_backend.weights import QuantWeight, repack
    from localllm.quant import QUANT_BY_NAME
    from localllm.quant.ggml import BLOCK_KERNELS

    layout, block_size, _ = BLOCK_KERNELS[qtype]
    ggml_type = QUANT_BY_NAME[qtype].ggml_type
    _, _, template = repack(np.zeros((1, k // block_size * layout.itemsize), np.uint8), ggml_type)
    g = torch.Generator(device=device).manual_seed(seed)
    planes = []
    for i, t in enumerate(template):
        dtype = torch.from_numpy(t).dtype
        shape = (n, *t.shape[1:])
        if dtype == torch.float16:
            plane = (torch.rand(shape, generator=g, device=device) * 0.04 - 0.02).half()
        else:
            top = 64 if (qtype in ("Q4_K", "Q5_K") and i == 1) else 256
            nbytes = int(np.prod(shape)) * t.itemsize
            raw = torch.randint(0, top, (nbytes,), generator=g, device=device, dtype=torch.uint8)
            plane = raw.view(dtype).view(shape)
        planes.append(plane.contiguous())
    return QuantWeight(qtype, (n, k), tuple(planes))


def configs(qtype: str, small: bool = False) -> list[Any]:
    """The type's default config first, then the grid's (small: its first 3) at every programs target."""
    from localllm.backends.torch_backend import triton_quant as tq

    grid = KQUANT if qtype in tq.KQUANTS else LEGACY
    tried = [
        tq.KernelConfig(block_n=bn, step=s, num_warps=w, num_stages=st, programs=p)
        for bn, s, w, st in grid[: 3 if small else None]
        for p in PROGRAMS
    ]
    return list(dict.fromkeys([tq.GEMV_CONFIGS[qtype], *tried]))


def sweep_one(
    qtype: str, n: int, k: int, device: Any, copy: float, small: bool = False
) -> list[dict[str, Any]]:
    """One row per GEMV config, and one for the default GEMM at 64 rows."""
    import torch

    from localllm.backends.torch_backend import triton_quant as tq
    from localllm.backends.torch_backend.weights import dequantize_torch

    w = random_weight(qtype, n, k, device)
    x = torch.randn(1, k, device=device, generator=torch.Generator(device=device).manual_seed(1))
    ref = dequantize_torch(w).double()
    copies = _copies(w, device)
    rows = []
    for c in configs(qtype, small):
        ok = _close(tq.gemv(x, w, config=c), x, ref)
        row = {"type": qtype, "shape": f"{n}x{k}", "kernel": "gemv", "config": asdict(c), "ok": ok}
        row["default"] = c == tq.GEMV_CONFIGS[qtype]
        if device.type == "cuda":
            t = _seconds_graph([lambda v=v, c=c: tq.gemv(x, v, config=c) for v in copies])
            row.update(us=t * 1e6, gbps=w.nbytes / t / 1e9, share=w.nbytes / t / copy)
        rows.append(row)
        _progress(row)
    for row in _gemm_rows(qtype, n, k, w, ref, copies, device):
        rows.append(row)
        _progress(row)
    return rows


def _gemm_kinds(qtype: str) -> tuple[str, ...]:
    """The GEMM kernels timed per type: the default; legacy types also the per-value one (the one
    before the block-structured GEMM), k-quants also the 2-D-tile one (triton_kquant2d.py)."""
    from localllm.backends.torch_backend import triton_quant as tq

    return ("gemm", "2d") if qtype in tq.KQUANTS else ("gemm", "generic")


def _gemm_rows(qtype: str, n: int, k: int, w: Any, ref: Any, copies: list[Any], device: Any) -> list[dict]:
    """The GEMM per kernel (_gemm_kinds) at 64 rows (kernel "gemm64", "gemm64-generic", "gemm64-2d");
    k-quants' two kernels also at 16 rows ("gemm16", "gemm16-2d")."""
    import torch

    from localllm.backends.torch_backend import triton_quant as tq

    rows = []
    for m in (64, 16) if qtype in tq.KQUANTS else (64,):
        xs = torch.randn(m, k, device=device)
        for kind in _gemm_kinds(qtype):
            config = {"gemm": tq.GEMM_CONFIGS[qtype], "generic": tq.GENERIC_GEMM, "2d": tq.KQUANT_GEMM_2D}
            rows.append(_gemm_row(qtype, n, k, w, ref, copies, xs, kind, config[kind]))
    return rows


def _gemm_row(qtype: str, n: int, k: int, w: Any, ref: Any, copies: list[Any], xs: Any, kind: str,
              config: Any) -> dict:  # fmt: skip
    """One GEMM's row: checked against ref (tf32x3 on CUDA, exact float32 on the CPU), timed on CUDA."""
    from localllm.backends.torch_backend import triton_quant as tq

    cuda = xs.device.type == "cuda"
    generic = kind == "generic"
    got = tq.gemm(xs, w, precision="tf32x3" if cuda else "ieee", generic=generic, config=config)
    m = xs.shape[0]
    name = f"gemm{m}" + ("" if kind == "gemm" else f"-{kind}")
    row = {"type": qtype, "shape": f"{n}x{k}", "kernel": name, "config": asdict(config)}
    row.update(ok=_close(got, xs, ref, tf32=cuda), default=kind == "gemm")
    if cuda:
        t = _seconds([lambda v=v: tq.gemm(xs, v, generic=generic, config=config) for v in copies], reps=5)
        row.update(us=t * 1e6, tflops=2 * m * n * k / t / 1e12, gbps=w.nbytes / t / 1e9)
    return row


def _copies(w: Any, device: Any) -> list[Any]:
    """w and clones of it, together over 3x the L2 cache (CUDA), so a cycle of launches reads HBM."""
    import torch

    from localllm.backends.torch_backend.weights import QuantWeight

    if device.type != "cuda":
        return [w]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
    count = max(2, -(-3 * l2 // w.nbytes))
    return [w] + [QuantWeight(w.qtype, w.shape, tuple(p.clone() for p in w.planes)) for _ in range(count - 1)]


def _close(got: Any, x: Any, ref: Any, tf32: bool = False) -> bool:
    """|got - x @ ref.T| within K * 2^-23 * (|x| @ |ref|.T), any float32 order (tf32x3: 4x that)."""
    xd = x.double()
    err = (got.double() - xd @ ref.T).abs()
    bound = ref.shape[1] * 2.0**-23 * (xd.abs() @ ref.abs().T) * (4 if tf32 else 1)
    return bool((err <= bound + 1e-30).all())


def _seconds(fns: list[Any] | Any, reps: int = REPS) -> float:
    """Seconds per call over reps calls cycling through fns, after a warm-up (CUDA events)."""
    import torch

    fns = fns if isinstance(fns, list) else [fns]
    for f in fns:
        f()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for i in range(reps):
        fns[i % len(fns)]()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1000 / reps


def _seconds_graph(fns: list[Any]) -> float:
    """As _seconds, the REPS calls captured in one CUDA graph (a decode step's way: no launch gaps);
    plain launches where capture fails."""
    import torch

    try:
        for f in fns:
            f()  # compiled and warm before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(REPS):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1000 / REPS
    except RuntimeError as e:
        print(f"  (no CUDA graph: {e}; timing plain launches)", file=sys.stderr)
        return _seconds(fns)


def mark_best(rows: list[dict[str, Any]]) -> None:
    """best: the fastest GEMV per (type, shape) (on the CPU, none is timed: the first)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        r["best"] = False
        if r["kernel"] == "gemv":
            groups.setdefault((r["type"], r["shape"]), []).append(r)
    for group in groups.values():
        max(group, key=lambda r: r.get("gbps", 0.0))["best"] = True


def _config_text(c: dict[str, Any]) -> str:
    kernel = "" if c.get("kernel", "default") == "default" else f" {c['kernel']}"
    return f"n{c['block_n']} s{c['step']} w{c['num_warps']} st{c['num_stages']} p{c['programs']}{kernel}"


def _progress(r: dict[str, Any]) -> None:
    speed = f"{r['gbps']:7.0f} GB/s {r.get('share', 0):4.0%}" if "gbps" in r else ""
    ok = "ok" if r["ok"] else "WRONG"
    line = f"  {r['type']:5} {r['shape']:>10} {r['kernel']:14} {_config_text(r['config']):24} {speed}"
    print(f"{line} {r['tflops']:5.1f} TFLOP/s {ok}" if "tflops" in r else f"{line} {ok}", flush=True)


def print_table(rows: list[dict[str, Any]], copy: float, seconds: float) -> None:
    """Per (type, shape): the best and the default GEMV; the GEMM at 64 rows in TFLOP/s (beside it the
    other kernel: legacy types' per-value one, k-quants' 2-D-tile one) and k-quants' at 16 rows in us."""
    print(f"\ndevice copy {copy / 1e9:.0f} GB/s; sweep took {seconds:.0f} s")
    head = f"{'type':5} {'N x K':>10}  {'best GEMV config':24} {'GB/s':>6} {'copy':>5}"
    head += f"  {'default':>7} {'copy':>5}  {'GEMM64 TFLOP/s':>14} {'(other)':>8}"
    print(f"{head}  {'GEMM16 us (2d)':>15}")
    for key in dict.fromkeys((r["type"], r["shape"]) for r in rows):
        group = {r["kernel"]: r for r in rows if (r["type"], r["shape"]) == key and r["kernel"] != "gemv"}
        gemv = [r for r in rows if (r["type"], r["shape"]) == key and r["kernel"] == "gemv"]
        best = next(r for r in gemv if r["best"])
        default = next(r for r in gemv if r["default"])
        other = group.get("gemm64-generic", group.get("gemm64-2d", {}))
        g16, g16_2d = group.get("gemm16", {}), group.get("gemm16-2d", {})
        print(
            f"{key[0]:5} {key[1]:>10}  {_config_text(best['config']):24} {best.get('gbps', 0):6.0f}"
            f" {best.get('share', 0):5.0%}  {default.get('gbps', 0):7.0f} {default.get('share', 0):5.0%}"
            f"  {group['gemm64'].get('tflops', 0):14.1f} {other.get('tflops', 0):8.1f}"
            f"  {g16.get('us', 0):7.0f} ({g16_2d.get('us', 0):5.0f})"
        )
    wrong = sum(not r["ok"] for r in rows)
    print(f"results: {len(rows) - wrong} of {len(rows)} within float32 rounding of dequantize(w) @ x")


if __name__ == "__main__":
    sys.exit(main())
