"""End-to-end decode rate with an f16 and a q8_0 KV cache (K and V), alternating rounds in one process.

    python scripts/bench_kv_decode.py MODEL.gguf [-p 1024] [-n 64] [-t 2] [-r 3]

Each round prefills a fresh random prompt of -p tokens on each engine (no prefix-cache hits), then
times the -n greedy decode steps after the first token; prints tokens/s per round and the best of
each, with the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.sampling_params import SamplingParams


def decode_rate(engine: LLMEngine, prompt: list[int], n: int) -> float:
    """Tokens/s of the decode steps after the prompt's first sampled token."""
    params = SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
    engine.add_request(prompt, params)
    start, tokens = 0.0, 0
    while engine.has_unfinished():
        outs = engine.step()
        got = sum(1 for o in outs if o.token_id is not None)
        if got and not start:
            start = time.perf_counter()
        elif start:
            tokens += got
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=1024)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    engines = {
        c: LLMEngine(EngineConfig(model=a.model, threads=a.t, cache_type_k=c, cache_type_v=c))
        for c in ("f16", "q8_0")
    }
    rng = np.random.default_rng(0)
    best = dict.fromkeys(engines, 0.0)
    for r in range(a.r + 1):  # round 0 warms up (compiles)
        for c, e in engines.items():
            rate = decode_rate(e, rng.integers(100, 20000, a.p).tolist(), a.n)
            if r:
                best[c] = max(best[c], rate)
                print(f"round {r} {c}: {rate:.2f} tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
    ratio = best["q8_0"] / best["f16"]
    print(f"best: f16 {best['f16']:.2f}, q8_0 {best['q8_0']:.2f} tok/s, q8_0/f16 = {ratio:.3f}")


if __name__ == "__main__":
    main()
