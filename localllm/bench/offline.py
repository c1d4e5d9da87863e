"""Offline benchmark in llama-bench's shape: prompt processing (ppN) and text generation (tgN) rates.

Every test runs twice to warm up, then `reps` times; rows report mean and standard deviation of tokens/s.
Decode rows also report the weight bandwidth they achieve (bytes of weights read per token x tokens/s),
since CPU decode is bound by memory bandwidth. A llama-bench binary, when given, runs in the same
process tree on the same model so the two can be compared under the same machine load.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class BenchPlan:
    """What to run: prompt lengths (ppN), generation lengths (tgN), each tgN after each context depth
    (llama-bench's -d), and the KV cache types (k, v) every test uses."""

    prompts: list[int]
    gens: list[int]
    depths: list[int] = field(default_factory=lambda: [0])
    kv: tuple[str, str] = ("f16", "f16")


def bench_label(kind: str, n: int, depth: int = 0) -> str:
    """pp512, tg128, or tg128@d2048 after 2,048 tokens of context."""
    return f"{kind}{n}" + (f"@d{depth}" if depth else "")


@dataclass
class BenchRow:
    engine: str  # "localllm" or "llama.cpp"
    model: str
    size_bytes: int
    params: int
    quant: str
    backend: str
    threads: int
    test: str  # pp512, tg128, tg128@b16
    samples: list[float] = field(default_factory=list)  # tokens/s per repetition
    bandwidth_gbs: float | None = None
    peak_rss_mb: float | None = None
    type_k: str = "f16"  # KV cache types
    type_v: str = "f16"

    @property
    def kv(self) -> str:
        return self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def sd(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.mean, "sd": self.sd}


def decode_weight_bytes(gf: Any) -> int:
    """Bytes of weights one sequence's decode step reads: every matrix, plus the output projection
    (which is the embedding table when tied); the embedding lookup itself reads a single row, and a
    mixture of experts reads its routed experts' share (experts used / experts) of their tensors."""
    experts, used = gf.arch_get("expert_count") or 0, gf.arch_get("expert_used_count") or 0
    moe = 0 < used < experts
    routed = sum(t.nbytes for name, t in gf.tensors.items() if moe and "_exps." in name)
    total = sum(t.nbytes for name, t in gf.tensors.items() if name != "token_embd.weight") - routed
    if "output.weight" not in gf.tensors:
        total += gf.tensors["token_embd.weight"].nbytes
    return total + (routed * used // experts if moe else 0)


def model_facts(gf: Any) -> dict[str, Any]:
    from localllm.quant import type_name

    params = sum(int(np.prod(t.shape)) for t in gf.tensors.values())
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) > 1:
            counts[type_name(t.ggml_type)] = counts.get(type_name(t.ggml_type), 0) + t.nbytes
    quant = max(counts, key=counts.get) if counts else "F32"
    name = gf.get("general.name") or gf.path.stem
    return {"model": str(name), "size_bytes": gf.size, "params": params, "quant": quant}


WARMUP_RUNS = 2  # see OfflineBench._repeat


class OfflineBench:
    def __init__(self, engine: Any, reps: int, seed: int = 0):
        self.engine = engine
        self.reps = reps
        self.rng = np.random.default_rng(seed)
        self.facts = model_facts(engine.gguf)
        self.weight_bytes = decode_weight_bytes(engine.gguf)

    def _row(self, test: str) -> BenchRow:
        cfg = self.engine.config
        row = BenchRow("localllm", backend=cfg.backend, threads=cfg.num_threads, test=test, **self.facts)
        row.type_k, row.type_v = cfg.cache_type_k, cfg.cache_type_v
        return row

    def _random_prompt(self, n: int) -> list[int]:
        # random ids, as llama-bench uses: no prefix cache hit, no early end of generation
        return self.rng.integers(100, self.engine.args.vocab_size - 100, size=n).tolist()

    def _repeat(self, once) -> list[float]:
        # Warm-up: the kernels, and the thread governor's first look at this test's step sizes with
        # each thread count (threads.py); with one warm-up run, a 512-token prefill's first timed run
        # was always its 1-thread probe, half the 2-thread rate on a quiet machine.
        for _ in range(WARMUP_RUNS):
            once()
        return [once() for _ in range(self.reps)]

    def prompt_processing(self, n_prompt: int) -> BenchRow:
        from localllm.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def once() -> float:
            out = self.engine.generate([self._random_prompt(n_prompt)], params)[0]
            return n_prompt / out.ttft

        row = self._row(f"pp{n_prompt}")
        row.samples = self._repeat(once)
        return row

    def text_generation(self, n_gen: int, batch: int = 1, depth: int = 0) -> BenchRow:
        """Decode n_gen tokens in each of `batch` sequences after a prompt of `depth` tokens (one when 0);
        aggregate tokens/s of the decode alone (the prompt's time, up to the first token, is left out)."""
        from localllm.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=n_gen + 1, ignore_eos=True)

        def once() -> float:
            outs = self.engine.generate([self._random_prompt(max(depth, 1)) for _ in range(batch)], params)
            decode_time = max(o.elapsed for o in outs) - max(o.ttft for o in outs)
            return batch * n_gen / decode_time

        row = self._row(bench_label("tg", n_gen, depth) if batch == 1 else f"tg{n_gen}@b{batch}")
        row.samples = self._repeat(once)
        row.bandwidth_gbs = self.weight_bytes * row.mean / batch / 1e9
        from localllm.bench.system import peak_rss_mb

        row.peak_rss_mb = peak_rss_mb()
        return row


def _joined(values: list[int]) -> str:
    return ",".join(map(str, values)) or "0"


def run_llama_bench(binary: str, model: Path, plan: BenchPlan, threads: int, reps: int) -> list[BenchRow]:
    """llama.cpp's own numbers for the same tests, parsed from `llama-bench -o json`. Its -d applies to
    its pp tests too, so those run in a second call without it (ours run pp on an empty cache)."""
    rows = _llama_bench_rows(binary, model, BenchPlan(plan.prompts, [], [0], plan.kv), threads, reps)
    return rows + _llama_bench_rows(
        binary, model, BenchPlan([], plan.gens, plan.depths, plan.kv), threads, reps
    )


def _llama_bench_rows(binary: str, model: Path, plan: BenchPlan, threads: int, reps: int) -> list[BenchRow]:
    if not plan.prompts and not plan.gens:
        return []
    cmd = [binary, "-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json"]
    cmd += ["-p", _joined(plan.prompts), "-n", _joined(plan.gens), "-d", _joined(plan.depths)]
    cmd += ["-ctk", plan.kv[0], "-ctv", plan.kv[1]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        from localllm.errors import LocalLLMError

        raise LocalLLMError(f"llama-bench failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    rows = []
    for r in json.loads(result.stdout):
        depth = int(r.get("n_depth", 0))
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else bench_label("tg", r["n_gen"], depth)
        row = BenchRow(
            "llama.cpp",
            str(r.get("model_type", model.stem)),
            int(r.get("model_size", 0)),
            int(r.get("model_n_params", 0)),
            "",
            "ggml-cpu",
            int(r["n_threads"]),
            test,
        )
        row.samples = [float(x) for x in r.get("samples_ts", [r["avg_ts"]])]
        row.type_k, row.type_v = r.get("type_k", plan.kv[0]), r.get("type_v", plan.kv[1])
        rows.append(row)
    return rows


def ratios(rows: list[BenchRow]) -> list[tuple[str, int, float]]:
    """(test, threads, localllm / llama.cpp) for every test both engines ran."""
    theirs = {(r.test, r.threads): r.mean for r in rows if r.engine == "llama.cpp"}
    return [
        (r.test, r.threads, r.mean / theirs[(r.test, r.threads)])
        for r in rows
        if r.engine == "localllm" and theirs.get((r.test, r.threads))
    ]
