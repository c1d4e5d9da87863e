"""Check a GPU machine in one command, and print one table of what it measured.

    python scripts/device_check.py                       # CUDA: 1B and 8B shapes (under ~8 min on an H100)
    python scripts/device_check.py --device cpu --shapes tiny --skip tests,serve   # CI's smoke run

Sections (each timed; one that fails is reported and the rest still run):
- env: Python, torch, CUDA and driver, Triton, the device.
- tests: the `gpu`-marked tests and tests/backends (the Triton kernels compiled for this device).
- kernels: each quantized type's Triton GEMV on an 8192x8192 matrix, in GB/s of its weight bytes and as
  a share of a measured device copy (2 x bytes / time), beside cuBLAS's bf16 GEMV; on the CPU, the
  kernels lowered to sm_90 instead.
- archs: every random-weight architecture of tests/data/arch through the torch backend on the device,
  against llama.cpp's fixtures (teacher-forced choices and greedy up to the first near-tie).
- bench: per shape, a random llama written as Q4_K_M (scripts/device_models.py), loaded on the device:
  weight memory against the file's tensor bytes, decode at 1 and 64 sequences, peak device memory, and
  the roofline ratio (decode bytes per token x tokens/s over the device copy's bandwidth).
- serve: `localllm bench serve` on the same file at concurrency 1/16/64 (throughput, TPOT, failures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_models import SHAPES, write_q4_k_m  # noqa: E402

SECTIONS = ("env", "tests", "kernels", "archs", "bench", "serve")


class Report:
    """Rows of (section, item, value, note), printed as one table at the end; a deadline for sections."""

    def __init__(self, budget_s: float):
        self.rows: list[tuple[str, str, str, str]] = []
        self.deadline = time.monotonic() + budget_s

    def add(self, section: str, item: str, value: Any, note: str = "") -> None:
        self.rows.append((section, item, str(value), note))
        print(f"[{section}] {item}: {value} {note}".rstrip(), flush=True)

    def run(self, section: str, fn: Callable[[], None]) -> None:
        if time.monotonic() > self.deadline:
            self.add(section, "skipped", "time budget spent")
            return
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # one section's failure must not hide the others' figures
            self.add(section, "FAILED", f"{type(e).__name__}: {e}".splitlines()[0][:160])
            traceback.print_exc()
        self.add(section, "seconds", f"{time.monotonic() - start:.0f}")

    def table(self) -> str:
        widths = [max(len(r[i]) for r in self.rows + [("section", "item", "value", "")]) for i in range(3)]
        lines = [
            "section".ljust(widths[0]) + "  " + "item".ljust(widths[1]) + "  " + "value".ljust(widths[2])
        ]
        lines.append("-" * (sum(widths) + 6 + 20))
        for sec, item, value, note in self.rows:
            lines.append(f"{sec.ljust(widths[0])}  {item.ljust(widths[1])}  {value.ljust(widths[2])}  {note}")
        return "\n".join(lines)


# ---- env ---------------------------------------------------------------------------------------------


def check_env(r: Report, device: str) -> None:
    import torch

    r.add("env", "python", platform.python_version())
    r.add("env", "torch", torch.__version__, f"CUDA {torch.version.cuda}")
    try:
        import triton

        r.add("env", "triton", triton.__version__)
    except ImportError:
        r.add("env", "triton", "absent", "quantized matmuls use the torch-op path")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        r.add(
            "env",
            "device",
            props.name,
            f"{props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}",
        )
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        r.add("env", "driver", smi.stdout.strip() or "?")
    else:
        r.add("env", "device", device, platform.processor() or platform.machine())


# ---- tests -------------------------------------------------------------------------------------------


def check_tests(r: Report, device: str) -> None:
    """Every `gpu`-marked test, and the kernel tests (compiled for this device on CUDA)."""
    # Only the torch back end's files: the rest of the suite needs test-only packages (openai, playwright,
    # ...) that a GPU image need not have, and runs on the CPU in CI anyway.
    files = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "tests" / "backends").glob("test_torch_*.py"))]
    runs = {"gpu-marked": [*files, "-m", "gpu"], "torch back end": [*files, "-m", "not slow and not gpu"]}
    if device != "cuda":
        runs["torch back end"] += ["-k", "not lower"]  # (the sm_90 lowering is the kernels section's)
    for name, args in runs.items():
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        ok = run.returncode == 0 or (run.returncode == 5 and device != "cuda")  # 5: none collected
        r.add("tests", name, "ok" if ok else f"FAILED (rc {run.returncode})", summary)
        if not ok:
            print(run.stdout[-4000:], run.stderr[-2000:])


# ---- kernels -----------------------------------------------------------------------------------------


def copy_bandwidth(device: str) -> float:
    """Bytes a device copy moves per second (read + write), over 1 GiB (64 MiB on the CPU)."""
    import torch

    n = (1 << 28) if device == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    seconds = _timed(lambda: b.copy_(a), device)
    return 2 * a.numel() * 4 / seconds


def _timed(fn: Callable[[], Any], device: str, reps: int = 20) -> float:
    """Seconds per call, after warm-up (CUDA events on CUDA)."""
    import torch

    for _ in range(3):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1000 / reps


def check_kernels(r: Report, device: str, copy_bw: float) -> None:
    if device != "cuda":
        return _compile_only(r)
    import numpy as np
    import torch
    import torch.nn.functional as F
    from device_models import random_blocks

    from localllm.backends.torch_backend import triton_quant as tq
    from localllm.backends.torch_backend.weights import TYPES, upload
    from localllm.quant import QUANT_BY_NAME

    n = k = 8192
    rng = np.random.default_rng(0)
    x, xs = torch.randn(1, k, device=device), torch.randn(64, k, device=device)
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    t = _timed(lambda: F.linear(x.bfloat16(), dense), device)
    r.add(
        "kernels",
        "cuBLAS bf16 GEMV 8192x8192",
        f"{n * k * 2 / t / 1e9:.0f} GB/s",
        _share(n * k * 2 / t, copy_bw),
    )
    for qtype in TYPES:
        raw = (
            random_blocks(qtype, n, k, rng) if qtype in ("Q4_K", "Q6_K") else _legacy_blocks(qtype, n, k, rng)
        )
        w = upload(raw, QUANT_BY_NAME[qtype].ggml_type, torch.device(device))
        t = _timed(lambda w=w: tq.gemv(x, w), device)
        r.add(
            "kernels",
            f"{qtype} GEMV 8192x8192",
            f"{w.nbytes / t / 1e9:.0f} GB/s",
            _share(w.nbytes / t, copy_bw),
        )
        t = _timed(lambda w=w: tq.gemm(xs, w), device, reps=5)
        r.add("kernels", f"{qtype} GEMM 64x8192x8192", f"{2 * 64 * n * k / t / 1e12:.1f} TFLOP/s")


def _legacy_blocks(qtype: str, n: int, k: int, rng: Any) -> Any:
    import numpy as np

    from localllm.quant.ggml import BLOCK_KERNELS

    layout, bs, _ = BLOCK_KERNELS[qtype]
    raw = np.frombuffer(rng.bytes(n * k // bs * layout.itemsize), dtype=np.uint8).reshape(n, -1).copy()
    blocks = raw.view(layout)
    for field in ("d", "m", "dmin"):
        if field in layout.names:
            blocks[field] = np.float16(0.001)
    if "e" in layout.names:  # MXFP4's exponent byte: 2^-10, where random bytes would overflow
        blocks["e"] = 118
    return raw


def _share(bytes_per_s: float, copy_bw: float) -> str:
    return f"{bytes_per_s / copy_bw:.0%} of the copy"


def _compile_only(r: Report) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from localllm.backends.torch_backend.triton_compile import compile_kernels\n"
        "for (k, q), v in compile_kernels(90, [('gemv', 'Q4_K'), ('gemm', 'Q4_K')]).items(): print(k, q, v)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    for line in run.stdout.strip().splitlines():
        kernel, qtype, info = line.split(" ", 2)
        r.add("kernels", f"{kernel} {qtype} -> sm_90", info)
    if run.returncode:
        r.add("kernels", "compile", f"FAILED: {run.stderr.strip().splitlines()[-1][:160]}")


# ---- archs -------------------------------------------------------------------------------------------


def check_archs(r: Report, device: str, work: Path) -> None:
    """Every random-weight architecture against llama.cpp's fixture, on the device."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from arch_conformance import compare, greedy, greedy_problem, load_fixture, near_tie, teacher_forced
    from tiny_arch import VARIANTS, write_variant
    from tiny_moe import MOE_VARIANTS, write_moe_variant

    passed, failed = 0, []
    for variant in [*VARIANTS, *MOE_VARIANTS]:
        path = work / f"arch-{variant}.gguf"
        (write_variant if variant in VARIANTS else write_moe_variant)(path, variant)
        ref = load_fixture(variant)
        e = _engine(path, device, ctx=128, seqs=1)
        problems = compare(teacher_forced(e, ref), ref, near_tie(ref))["problems"]
        g = greedy_problem(greedy(e, ref), ref)
        if problems or g:
            failed.append(f"{variant}: {(problems + [g])[0]}")
        else:
            passed += 1
    r.add("archs", "agree with llama.cpp", f"{passed}/{passed + len(failed)}", "; ".join(failed)[:300])


def _engine(path: Path, device: str, ctx: int, seqs: int) -> Any:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    config = EngineConfig(model=str(path), backend="torch", device=device, threads=0, ctx_size=ctx,
                          max_num_seqs=seqs, max_num_batched_tokens=max(512, seqs),
                          enable_prefix_caching=False)  # fmt: skip
    return LLMEngine(config)


# ---- bench and serve ---------------------------------------------------------------------------------


def check_bench(r: Report, device: str, shape: str, path: Path, copy_bw: float, n_gen: int) -> None:
    import torch

    from localllm.bench.offline import OfflineBench, decode_weight_bytes

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    e = _engine(path, device, ctx=2 * n_gen + 64, seqs=64)
    tensor_bytes = sum(t.nbytes for t in e.gguf.tensors.values())
    mem = e.backend.memory
    r.add("bench", f"{shape} weights on device", f"{mem.total / 2**20:.0f} MiB",
          f"{mem.total / tensor_bytes:.2f}x the file's tensors; {mem.describe()}")  # fmt: skip
    bench = OfflineBench(e, reps=2)
    one = bench.text_generation(n_gen, 1)
    many = bench.text_generation(n_gen, 64)
    r.add("bench", f"{shape} decode, 1 sequence", f"{one.mean:.0f} tok/s", f"tg{n_gen}")
    r.add(
        "bench", f"{shape} decode, 64 sequences", f"{many.mean:.0f} tok/s", f"{many.mean / one.mean:.1f}x one"
    )
    per_token = decode_weight_bytes(e.gguf)
    r.add("bench", f"{shape} roofline (1 sequence)", f"{one.mean * per_token / copy_bw:.0%}",
          f"{per_token / 1e9:.2f} GB a token at {copy_bw / 1e9:.0f} GB/s")  # fmt: skip
    if device == "cuda":
        r.add("bench", f"{shape} peak device memory", f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    for batch in (1, 16) if device == "cuda" else ():
        busy, wall = gpu_busy(e, n_gen, batch)
        note = f"of {wall * 1e3:.0f} ms (torch.profiler, CUDA activity)"
        r.add("bench", f"{shape} GPU busy, {batch} sequence(s)", f"{busy:.0%}", note)
    del e, bench
    if device == "cuda":
        torch.cuda.empty_cache()


def gpu_busy(e: Any, n_gen: int, batch: int) -> tuple[float, float]:
    """(share of wall time the GPU runs kernels or copies, wall seconds) over one generate of `batch` rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from localllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_gen + 1, ignore_eos=True)
    prompts = [[100 + i] for i in range(batch)]
    e.generate(prompts, params)  # warm: this batch size's graphs
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        e.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    device_us = sum(
        getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0))
        for ev in prof.key_averages()
    )
    return device_us / 1e6 / wall, wall


def check_serve(r: Report, device: str, shape: str, path: Path, work: Path, prompts: int) -> None:
    out = work / f"serve-{shape}.json"
    cmd = [sys.executable, "-m", "localllm", "bench", "serve", str(path), "--backend", "torch",
           "--concurrency", "1,16,64", "--num-prompts", str(prompts), "--input-len", "64",
           "--output-len", "32", "--ctx-size", "512", "--server-args", f"--device {device}",
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if run.returncode:
        raise RuntimeError(f"bench serve failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    for level in json.loads(out.read_text())["results"]:
        note = f"TPOT {level['tpot_ms']['mean']:.1f} ms, {level['failed']} failed"
        r.add(
            "serve",
            f"{shape} concurrency {level['concurrency']}",
            f"{level['output_throughput']:.0f} tok/s",
            note,
        )


# ---- main --------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--shapes", default="", help=f"comma-separated: {', '.join(SHAPES)} (default 1b,8b; cpu: tiny)"
    )
    p.add_argument("--skip", default="", help=f"sections to skip: {', '.join(SECTIONS)}")
    p.add_argument("--work", default="", help="folder for the model files (kept: a rerun reuses them)")
    p.add_argument(
        "--write", default="auto", choices=("auto", "quantize", "blocks"), help="how models are made"
    )
    p.add_argument("--weights", default="", choices=("", "dense", "quantized"),
                   help="torch backend weights (default: quantized on a GPU, dense on the CPU)")  # fmt: skip
    p.add_argument("--gen", type=int, default=64, help="tokens each sequence decodes in bench")
    p.add_argument("--serve-prompts", type=int, default=64)
    p.add_argument("--budget", type=float, default=480, help="seconds; later sections are skipped past it")
    p.add_argument("--json", default="", help="also write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.weights:  # read by the torch backend, here and in the servers bench serve starts
        os.environ["LOCALLLM_TORCH_WEIGHTS"] = a.weights
    skip = {s for s in a.skip.split(",") if s}
    shapes = [s for s in (a.shapes or ("1b,8b" if a.device == "cuda" else "tiny")).split(",") if s]
    work = Path(a.work or tempfile.mkdtemp(prefix="device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    r = Report(a.budget)
    r.run("env", lambda: check_env(r, a.device))
    copy_bw = copy_bandwidth(a.device)
    r.add("env", "device copy", f"{copy_bw / 1e9:.0f} GB/s", "2 x bytes / time")
    for section, fn in (("tests", lambda: check_tests(r, a.device)),
                        ("kernels", lambda: check_kernels(r, a.device, copy_bw)),
                        ("archs", lambda: check_archs(r, a.device, work))):  # fmt: skip
        if section not in skip:
            r.run(section, fn)
    for shape in shapes:
        path, how = write_q4_k_m(work, SHAPES[shape], a.write)
        r.add("bench", f"{shape} model", path.name, f"{path.stat().st_size / 2**30:.2f} GiB, by {how}")
        if "bench" not in skip:
            r.run(
                "bench", lambda shape=shape, path=path: check_bench(r, a.device, shape, path, copy_bw, a.gen)
            )
        if "serve" not in skip:
            r.run(
                "serve",
                lambda shape=shape, path=path: check_serve(r, a.device, shape, path, work, a.serve_prompts),
            )
    print("\n" + r.table())
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                [dict(zip(("section", "item", "value", "note"), row, strict=True)) for row in r.rows],
                indent=1,
            )
        )
    return 1 if any(row[1] == "FAILED" or row[2].startswith("FAILED") for row in r.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
