"""Warm restart with the prefix cache's disk tier: a long prompt's TTFT in a fresh process that finds its
blocks on disk, against a cold prefill and an in-memory cache hit, with the logprobs compared.

    python scripts/bench_kv_restart.py MODEL.gguf --tokens 4096 --threads 2

Phase 1 (a process): the prompt cold (its blocks written to a fresh disk cache), then again (memory hit).
Phase 2 (a new process, as after a restart): the prompt restored from disk, then again (memory hit).
Each phase prints one JSON line; the parent prints the ratios and whether the first four tokens' top-5
logprobs are identical in all four requests. With --warm each process first serves a short unrelated
request, so the restored request does not also pay a fresh process's first step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def phase(model: str, tokens: int, threads: int, disk: str, warm: bool, prefault: bool = True) -> None:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.sampling_params import SamplingParams

    if not prefault:  # restores fault the pool's pages in one by one (nor are they made resident at start)
        import localllm.engine.kv_cache

        localllm.engine.kv_cache.PREFAULT_BLOCKS = 0
    home = Path("~/.cache/localllm").expanduser()
    config = EngineConfig(
        model=model, backend="numba", threads=threads, index_dir=home / "index", ctx_size=tokens + 512,
        max_num_seqs=1, kv_disk_mb=4096, kv_disk_dir=Path(disk),
    )  # fmt: skip
    engine = LLMEngine(config)
    text = "".join(p.read_text() for p in sorted(Path("localllm").rglob("*.py")))
    ids = engine.tokenize_prompt(text)[:tokens]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    if warm:  # a first short request, so the measured ones do not carry a fresh process's first step
        engine.generate([ids[-64:][::-1]], params)
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        out = engine.generate([ids], params)[0]
        lps = [[t.token_id, t.logprob, t.top] for t in out.logprobs]
        runs.append(
            {"ttft": out.ttft, "total": time.perf_counter() - start, "cached": out.cached_tokens, "lp": lps}
        )
    engine.block_manager.tier.flush(600)
    print(json.dumps({"runs": runs, "disk": engine.stats().kv_disk.__repr__()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="a short unrelated request first in each process")
    ap.add_argument(
        "--compare-prefault",
        type=int,
        default=0,
        metavar="N",
        help="N rounds of restarts without and with the pool's pages pre-faulted, alternating",
    )
    ap.add_argument("--no-prefault", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        phase(args.model, args.tokens, args.threads, args.disk, args.warm, not args.no_prefault)
        return
    disk = tempfile.mkdtemp(prefix="kv-restart-")
    names = ["first", "restarted"]
    if args.compare_prefault:
        names = ["first"] + ["restarted-no-prefault", "restarted"] * args.compare_prefault
    results = [_phase(args, name, disk) for name in names]
    if args.compare_prefault:
        _compare_prefault(names, results)
    cold, hit1 = results[0]["runs"]
    restored, hit2 = results[-1]["runs"]
    print(f"TTFT cold {cold['ttft']:.3f} s, memory hit {hit1['ttft']:.3f} / {hit2['ttft']:.3f} s, "
          f"restored from disk {restored['ttft']:.3f} s")  # fmt: skip
    hit = min(hit1["ttft"], hit2["ttft"])
    ratios = f"restored / memory hit = {restored['ttft'] / hit:.2f}x"
    print(f"{ratios}; cold / restored = {cold['ttft'] / restored['ttft']:.1f}x")
    same = all(r["lp"] == cold["lp"] for r in (hit1, restored, hit2))
    print(f"first 4 tokens' top-5 logprobs identical in all four requests: {same}")
    shutil.rmtree(disk, ignore_errors=True)


def _phase(args: argparse.Namespace, name: str, disk: str) -> dict:
    """One phase in a fresh process (as after a restart), its JSON line."""
    cmd = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--threads", str(args.threads)]
    cmd += ["--warm"] * args.warm + ["--no-prefault"] * name.endswith("no-prefault")
    out = subprocess.run([*cmd, "--phase", name, "--disk", disk], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(name, json.dumps([{k: v for k, v in r.items() if k != "lp"} for r in result["runs"]]))
    print("  ", result["disk"], flush=True)
    return result


def _compare_prefault(names: list[str], results: list[dict]) -> None:
    """Each restarted process's restored / memory-hit TTFT ratio, without and with pre-faulting."""
    for label in ("restarted-no-prefault", "restarted"):
        mine = [r["runs"] for n, r in zip(names, results, strict=True) if n == label]
        ratios = [runs[0]["ttft"] / runs[1]["ttft"] for runs in mine]
        restored = [runs[0]["ttft"] for runs in mine]
        print(f"{label}: restored / memory hit = {', '.join(f'{x:.2f}x' for x in ratios)}; "
              f"restored TTFT {', '.join(f'{x:.3f}' for x in restored)} s")  # fmt: skip


if __name__ == "__main__":
    main()
