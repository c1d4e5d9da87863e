"""Where a decode step's time goes, per thread count: the fused layer stack, the output projection, the rest
(Python: scheduling, batch preparation, sampling), as wall time and as the process's CPU time.

    python scripts/profile_decode_step.py MODEL.gguf -t 1,2 -n 64 --rounds 3 [--team on,off]

The thread governor is pinned to the count under test (no 1-thread probes). Rounds alternate the thread
counts (and with --team on,off the dense layers' team stack against a launch per projection); each
figure is the median over every decode step of every round, and its lowest beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any


def _timed(times: dict[str, list[float]], name: str, fn: Any) -> Any:
    def wrapper(*a: Any, **k: Any) -> Any:
        w, c = time.perf_counter(), time.process_time()
        out = fn(*a, **k)
        times[name].append(time.perf_counter() - w)
        times[name + "_cpu"].append(time.process_time() - c)
        return out

    return wrapper


def load(model: str, threads: int) -> Any:
    from localllm.backends.threads import ModelGovernors
    from localllm.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=model, threads=threads))
    engine.backend._governors = ModelGovernors(threads, adaptive=False)
    return engine


def one_round(engine: Any, n: int, times: dict[str, list[float]]) -> None:
    from localllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params)
    engine.step()  # the prompt: its stack and output calls are not a decode step's
    for name in ("stack", "stack_cpu", "output", "output_cpu"):
        del times[name][-1:]
    while engine.has_unfinished():
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        times["step"].append(time.perf_counter() - w)
        times["step_cpu"].append(time.process_time() - c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-t", default="1,2")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--team", default="on", help="on, off, or on,off to alternate")
    a = ap.parse_args()
    configs = [(int(t), m == "on") for t in a.t.split(",") for m in a.team.split(",")]
    engine = load(a.model, max(t for t, _ in configs))
    backend = engine.backend
    times: dict[tuple, dict[str, list[float]]] = {c: defaultdict(list) for c in configs}
    orig_layers, orig_precise = backend.run_layers, backend.linear_precise
    import numba

    from localllm.backends.threads import ModelGovernors

    for r in range(a.rounds + 1):
        for t, team in configs:
            tt = times[t, team] if r else defaultdict(list)  # round 0 warms up
            backend.run_layers = _timed(tt, "stack", orig_layers)
            backend.linear_precise = _timed(tt, "output", orig_precise)
            backend._governors = ModelGovernors(t, adaptive=False)
            backend.threads, backend.team_stack = t, team
            numba.set_num_threads(t)
            one_round(engine, a.n, tt)
    print("ms, median (lowest) over steps")
    print("| threads | team | step | stack | output | rest | step cpu | stack cpu | output cpu |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t, team in configs:
        print(f"| {t} | {'on' if team else 'off'} | " + " | ".join(_cells(times[t, team])) + " |")


def _cells(tt: dict[str, list[float]]) -> list[str]:
    med = {k: statistics.median(v) * 1e3 for k, v in tt.items()}
    low = {k: min(v) * 1e3 for k, v in tt.items()}
    med["rest"] = med["step"] - med["stack"] - med["output"]
    parts = zip(tt["step"], tt["stack"], tt["output"], strict=True)
    low["rest"] = statistics.median([a - b - c for a, b, c in parts]) * 1e3
    names = ["step", "stack", "output", "rest", "step_cpu", "stack_cpu", "output_cpu"]
    return [f"{med[k]:.3f} ({low[k]:.3f})" if k != "rest" else f"{med[k]:.3f}" for k in names]


if __name__ == "__main__":
    main()
