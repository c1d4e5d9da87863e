"""Where a serving step's time goes on the torch back end: a serving-like mix (a new prompt arriving
every other step, each decoding a fixed number of tokens) run through `LLMEngine.step`, with each step's
wall time split into steps right after an arrival (a prefill chunk rides along: the eager path) and the
others (decode only: the static/CUDA-graph path); then torch.profiler's top operators over a few steps.

    python scripts/gpu_step_profile.py MODEL.gguf                      # CUDA
    python scripts/gpu_step_profile.py MODEL.gguf --device cpu --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np


def engine_for(path: str, device: str) -> Any:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    config = EngineConfig(
        model=path, backend="torch", device=device, threads=0, ctx_size=1024, max_num_seqs=64,
        max_num_batched_tokens=512, enable_prefix_caching=False,
    )  # fmt: skip
    return LLMEngine(config)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_mix(e: Any, a: argparse.Namespace, rng: np.random.Generator, steps: int) -> dict[str, list[float]]:
    """Step times (s) by kind; one arrival every `a.every` steps, starting with a.seqs // 2 requests."""
    from localllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=a.gen, ignore_eos=True)
    vocab = e.args.vocab_size

    def arrive() -> None:
        e.add_request(rng.integers(100, vocab - 100, size=a.prompt).tolist(), params)

    for _ in range(a.seqs // 2):
        arrive()
    times: dict[str, list[float]] = {"after an arrival": [], "decode only": []}
    for i in range(steps):
        arrived = i % a.every == 0
        if arrived:
            arrive()
        start = time.perf_counter()
        e.step()
        sync(a.device)
        times["after an arrival" if arrived else "decode only"].append(time.perf_counter() - start)
    return times


def drain(e: Any) -> None:
    while e.has_unfinished():
        e.step()


def profile_steps(e: Any, a: argparse.Namespace, rng: np.random.Generator) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        run_mix(e, a, rng, a.profile_steps)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if a.device == "cuda":
        print(table.table(sort_by="self_device_time_total", row_limit=a.rows))
    del torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--every", type=int, default=2, help="steps between arrivals")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    e = engine_for(a.model, a.device)
    run_mix(e, a, rng, a.steps)  # warm-up: kernels compiled, graphs captured
    drain(e)
    times = run_mix(e, a, rng, a.steps)
    for kind, ts in times.items():
        ms = sorted(t * 1e3 for t in ts)
        print(f"{kind:>17}: {len(ms)} steps, median {statistics.median(ms):.1f} ms, "
              f"min {ms[0]:.1f}, max {ms[-1]:.1f}")  # fmt: skip
    drain(e)
    profile_steps(e, a, rng)


if __name__ == "__main__":
    main()
