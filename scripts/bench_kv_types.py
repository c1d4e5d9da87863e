"""Decode speed and pool memory of KV cache types, in one process with alternating rounds.

    python scripts/bench_kv_types.py MODEL.gguf --types f16,q8_0 --context 1024 --gen 64 --rounds 5

One engine per type (numba, --threads, prefix caching off). Each round runs every type once, in turn:
a random --context-token prompt, then --gen tokens decoded after it; decode tokens/s is gen / (elapsed -
time to first token). Prints each type's median, its ratio to the first type's, and the pool's bytes
per token and in all (the engine's KVLayout, as `localllm info -ctk/-ctv` shows it).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def engine_for(model: str, cache: str, threads: int, ctx: int):
    from pathlib import Path

    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    home = Path("~/.cache/localllm").expanduser()
    return LLMEngine(EngineConfig(
        model=model, threads=threads, index_dir=home / "index", ctx_size=ctx, max_num_seqs=1,
        enable_prefix_caching=False, cache_type_k=cache, cache_type_v=cache,
    ))  # fmt: skip


def decode_rate(engine, context: int, gen: int, rng: np.random.Generator) -> float:
    from localllm.sampling_params import SamplingParams

    ids = rng.integers(100, engine.args.vocab_size - 100, context).tolist()
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True))[0]
    return gen / (out.elapsed - out.ttft)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--types", default="f16,q8_0")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    types = a.types.split(",")
    engines = {t: engine_for(a.model, t, a.threads, a.context + a.gen + 64) for t in types}
    rng = np.random.default_rng(0)
    for e in engines.values():  # warm-up: kernels, thread governor
        decode_rate(e, a.context, 8, rng)
    rates: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(a.rounds):
        for t, e in engines.items():
            rates[t].append(decode_rate(e, a.context, a.gen, rng))
    base = statistics.median(rates[types[0]])
    first = engines[types[0]].kv_cache
    for t, e in engines.items():
        pool, pool0 = e.kv_cache.k.nbytes + e.kv_cache.v.nbytes, first.k.nbytes + first.v.nbytes
        row = {
            "type": t, "decode_tok_s": round(statistics.median(rates[t]), 2),
            "vs_" + types[0]: round(statistics.median(rates[t]) / base, 3),
            "samples": [round(r, 2) for r in rates[t]], "kv_bytes_per_token": e.kv_bytes_per_token,
            "pool_bytes": pool, "pool_vs_" + types[0]: round(pool / pool0, 4),
            "pool_blocks": e.kv_cache.num_blocks,
        }  # fmt: skip
        print(json.dumps(row))


if __name__ == "__main__":
    main()
