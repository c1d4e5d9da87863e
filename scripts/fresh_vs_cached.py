"""A model's logits from a process compiling every kernel afresh against a process loading them from its
cache: they must agree bit for bit (docs/benchmarks.md, "Fresh and cached kernels compute the same").

    python scripts/fresh_vs_cached.py MODEL.gguf [--tokens 512] [--threads 2]

Each child scores a prompt of random ids (seed 7) and then generates 16 greedy tokens from its first 300.
The first child runs with an empty NUMBA_CACHE_DIR (it compiles, minutes), the second loads from it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def child(model: str, out: str, tokens: int, threads: int) -> None:
    from localllm.engine.engine import EngineConfig, LLMEngine, score_tokens
    from localllm.sampling_params import SamplingParams

    prompt = [int(t) for t in np.random.default_rng(7).integers(100, 20000, tokens)]
    engine = LLMEngine(EngineConfig(model=model, threads=threads))
    logits = np.asarray(score_tokens(engine, prompt))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    generated = engine.generate([prompt[: min(300, tokens)]], params)[0].token_ids
    np.savez(out, logits=logits, tokens=np.asarray(generated))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.model, a.child, a.tokens, a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(Path(tmp) / "numba")}
        runs = []
        for name in ("fresh", "cached"):
            out = str(Path(tmp) / f"{name}.npz")
            cmd = [sys.executable, __file__, a.model, f"--tokens={a.tokens}", f"--threads={a.threads}"]
            subprocess.run([*cmd, f"--child={out}"], env=env, check=True)
            with np.load(out) as data:
                runs.append({k: data[k] for k in data.files})
    fresh, cached = runs
    diff = np.abs(fresh["logits"] - cached["logits"])
    flips = int((fresh["logits"].argmax(1) != cached["logits"].argmax(1)).sum())
    print(
        f"max logit difference {diff.max():.6g}; rows differing {int((diff.max(1) > 0).sum())} of "
        f"{diff.shape[0]}; top tokens differing {flips}; "
        f"generated tokens equal: {np.array_equal(fresh['tokens'], cached['tokens'])}"
    )


if __name__ == "__main__":
    main()
