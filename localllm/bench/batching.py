"""`localllm bench batching`: continuous vs static batching, and paged vs contiguous KV, in-process.

Every run uses the same LLMEngine (same kernels, same KV pool, prefix caching off so a repeated workload
gets no free hits); only how requests are fed changes:

* continuous: all requests queued at once, `max_num_seqs = concurrency`; a finished sequence's slot is
  refilled at the next step.
* static: requests fed in batches of `concurrency`; a batch runs until its longest member finishes.
* contiguous: continuous batching, but admitting only as many sequences as a contiguous (non-paged)
  allocator could hold in the same pool: `pool_tokens // slot_tokens`, where a slot is the largest
  `prompt + max_tokens` of the workload (the tightest fixed slot that fits every request).

During the continuous run the KV pool is sampled after every step: tokens actually held, slots in
allocated blocks (paged), and what a contiguous allocator would have reserved for the same running set.
Latencies count from the moment the whole workload was available, so queueing (static batching's cost)
is part of them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def lengths(self) -> list[int]:
        return [len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True)]


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' -> (64, 512); '128' -> (128, 128)."""
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LocalLLMError(f"expected a length or a range like 64:512, got {text!r}") from None
    if not 1 <= low <= high:
        raise LocalLLMError(f"the range {text!r} must satisfy 1 <= low <= high")
    return low, high


def make_workload(
    vocab_size: int, n: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> Workload:
    """Seeded mixed lengths; random token ids (as llama-bench uses) away from the special tokens."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_range[0], input_range[1] + 1, size=n)
    outs = rng.integers(output_range[0], output_range[1] + 1, size=n)
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    prompts = [rng.integers(lo, hi, size=int(k)).tolist() for k in ins]
    return Workload(prompts, [int(m) for m in outs])


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_engine(
    model: Path,
    backend: str,
    threads: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    max_concurrency: int,
    kv_tokens: int = 0,
    ctx_size: int = 0,
    index_dir: Path | None = None,
) -> Any:
    """One engine for the whole sweep, sized from the length ranges (not the draw), so the same flags give
    the same engine. The default pool holds max_concurrency sequences of the expected mean length: enough
    for paged blocks, tighter than contiguous slots, which is the realistic case."""
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    block = EngineConfig.__dataclass_fields__["block_size"].default
    ctx = ctx_size or _round_up(input_range[1] + output_range[1] + 1, block)
    mean_len = (sum(input_range) + sum(output_range)) / 2
    pool = kv_tokens or _round_up(int(max_concurrency * mean_len), block)
    config = EngineConfig(
        model=str(model),
        backend=backend,
        threads=threads,
        ctx_size=ctx,
        max_num_seqs=max_concurrency,
        num_kv_blocks=-(-pool // block),
        enable_prefix_caching=False,
        index_dir=index_dir,
    )
    engine = LLMEngine(config)
    _warm_up(engine)
    return engine


def _warm_up(engine: Any) -> None:
    """Compile/first-touch before anything is timed."""
    from localllm.sampling_params import SamplingParams

    engine.generate(
        [[100 % engine.args.vocab_size] * 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )


# ------------------------------------------------------------------------------------------------ KV use


def held_tokens(running: list[Any], block_size: int) -> int:
    """Tokens whose K/V sits in the running sequences' blocks (a shared block counted once)."""
    filled: dict[int, int] = {}
    for seq in running:
        for i, block_id in enumerate(seq.block_table):
            n = min(max(seq.num_computed_tokens - i * block_size, 0), block_size)
            filled[block_id] = max(filled.get(block_id, 0), n)
    return sum(filled.values())


@dataclass
class KVSampler:
    """Sums and peaks, over engine steps, of KV slots used, allocated (paged) and reserved (contiguous)."""

    context: int  # what a contiguous engine reserves per sequence when it does not know max_tokens
    totals: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    samples: int = 0

    def sample(self, engine: Any) -> None:
        bm, running = engine.block_manager, engine.scheduler.running
        allocated = (bm.num_blocks - bm.num_free_blocks) * bm.block_size
        if not allocated:
            return
        now = {
            "used": held_tokens(running, bm.block_size),
            "allocated": allocated,
            "reserved_max_tokens": sum(
                min(s.num_prompt_tokens + (s.params.max_tokens or self.context), self.context)
                for s in running
            ),
            "reserved_context": len(running) * self.context,
        }
        for key, value in now.items():
            self.totals[key] = self.totals.get(key, 0) + value
            self.peaks[key] = max(self.peaks.get(key, 0), value)
        self.samples += 1

    def summary(self, pool_tokens: int) -> dict[str, Any]:
        t = self.totals
        used = t.get("used", 0)

        def ratio(key: str) -> float:
            return used / t[key] if t.get(key) else 0.0

        return {
            "samples": self.samples,
            "pool_tokens": pool_tokens,
            "paged_used_over_allocated": ratio("allocated"),
            "internal_waste": 1.0 - ratio("allocated") if t.get("allocated") else 0.0,
            "contiguous_used_over_reserved_max_tokens": ratio("reserved_max_tokens"),
            "contiguous_used_over_reserved_context": ratio("reserved_context"),
            "mean_tokens": {k: v / self.samples for k, v in t.items()} if self.samples else {},
            "peak_tokens": dict(self.peaks),
        }


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class RunResult:
    mode: str  # continuous | static | contiguous
    concurrency: int
    max_num_seqs: int
    wall_s: float = 0.0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # s from workload start to each request's end
    ttfts: list[float] = field(default_factory=list)  # s from workload start to each first token
    preemptions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tokens_per_s": self.tokens_per_s,
            "latency_s": percentiles(self.latencies),
            "ttft_s": percentiles(self.ttfts),
        }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _drive(engine: Any, ids: list[str], t0: float, run: RunResult, sampler: KVSampler | None) -> None:
    """Step until every id has finished, recording first-token and finish times relative to t0."""
    pending, first = set(ids), {}
    while pending:
        outs = engine.step()
        now = time.perf_counter() - t0
        if sampler is not None:
            sampler.sample(engine)
        for out in outs:
            if out.request_id not in pending:
                continue
            first.setdefault(out.request_id, now)
            if out.finished:
                pending.discard(out.request_id)
                run.latencies.append(now)
                run.ttfts.append(first[out.request_id])
                run.output_tokens += out.generated_tokens


def _submit(engine: Any, workload: Workload, indices: range) -> list[str]:
    from localllm.sampling_params import SamplingParams

    # ignore_eos: every request generates exactly its max_tokens, so all modes do the same work
    return [
        engine.add_request(
            workload.prompts[i],
            SamplingParams(temperature=0, max_tokens=workload.max_tokens[i], ignore_eos=True),
        )
        for i in indices
    ]


def run_continuous(
    engine: Any,
    workload: Workload,
    max_num_seqs: int,
    concurrency: int,
    mode: str = "continuous",
    sampler: KVSampler | None = None,
) -> RunResult:
    engine.scheduler.max_num_seqs = max_num_seqs
    run = RunResult(mode, concurrency, max_num_seqs)
    preempted = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    _drive(engine, _submit(engine, workload, range(len(workload.prompts))), t0, run, sampler)
    run.wall_s = time.perf_counter() - t0
    run.preemptions = engine.scheduler.num_preemptions - preempted
    return run


def run_static(engine: Any, workload: Workload, batch: int) -> RunResult:
    """Batch after batch; the next batch is admitted only when the whole previous one has finished."""
    engine.scheduler.max_num_seqs = batch
    run = RunResult("static", batch, batch)
    preempted = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    for start in range(0, len(workload.prompts), batch):
        indices = range(start, min(start + batch, len(workload.prompts)))
        _drive(engine, _submit(engine, workload, indices), t0, run, None)
    run.wall_s = time.perf_counter() - t0
    run.preemptions = engine.scheduler.num_preemptions - preempted
    return run


def compare(
    engine: Any, workload: Workload, concurrencies: list[int], progress: Any = None
) -> dict[str, Any]:
    """The three runs per concurrency level, the continuous/static ratio and the KV accounting."""
    pool = engine.kv_capacity_tokens
    slot = min(max(workload.lengths), engine.max_model_len)
    levels = []
    for conc in concurrencies:
        sampler = KVSampler(engine.max_model_len)
        cont = run_continuous(engine, workload, conc, conc, "continuous", sampler)
        static = run_static(engine, workload, conc)
        fit = max(1, min(conc, pool // slot))
        contiguous = run_continuous(engine, workload, fit, conc, "contiguous")
        levels.append(
            {
                "concurrency": conc,
                "runs": {r.mode: r.as_dict() for r in (cont, static, contiguous)},
                "continuous_over_static": cont.tokens_per_s / static.tokens_per_s
                if static.tokens_per_s
                else 0.0,
                "kv": {**sampler.summary(pool), "contiguous_max_num_seqs": fit},
            }
        )
        if progress is not None:
            progress(conc)
    return {
        "pool_tokens": pool,
        "block_size": engine.block_manager.block_size,
        "slot_tokens": slot,
        "context": engine.max_model_len,
        "levels": levels,
    }


# ------------------------------------------------------------------------------------------------ report


def print_batching(result: dict[str, Any], info: dict[str, Any]) -> None:
    from rich.console import Console

    from localllm.bench.serving import system_caption

    console = Console()
    console.print(_runs_table(result, system_caption(info)))
    console.print(_kv_table(result))


RUN_COLUMNS = ("conc", "mode", "seqs", "tok/s", "p50 s", "p90 s", "p99 s", "preempt", "vs static")
KV_COLUMNS = ("conc", "paged waste", "paged peak", "contig used/resv", "contig used/ctx", "contig seqs")
KV_CAPTION = (
    "paged waste: allocated-but-empty slots inside blocks; paged peak: most of the pool in use at once; "
    "contig used/resv: tokens held / what prompt+max_tokens reservations would take for the same running "
    "set; contig used/ctx: the same if each sequence reserved the full context; contig seqs: sequences "
    "that fit the pool as contiguous slots (the contiguous run's limit)"
)


def _runs_table(result: dict[str, Any], caption: str) -> Any:
    """One row per (concurrency, mode); latencies are request latencies in seconds from workload start."""
    from rich import box
    from rich.table import Table

    title = "Continuous vs static batching (same engine, same KV pool)"
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    for col in RUN_COLUMNS:
        table.add_column(col, justify="left" if col == "mode" else "right")
    for level in result["levels"]:
        static_tps = level["runs"]["static"]["output_tokens_per_s"]
        for mode, run in level["runs"].items():
            lat, tps = run["latency_s"], run["output_tokens_per_s"]
            ratio = f"{tps / static_tps:.2f}x" if static_tps else "-"
            row = [str(level["concurrency"]), mode, str(run["max_num_seqs"]), f"{tps:.1f}"]
            row += [f"{lat[p]:.2f}" for p in ("p50", "p90", "p99")] + [str(run["preemptions"]), ratio]
            table.add_row(*row)
        table.add_section()
    return table


def _kv_table(result: dict[str, Any]) -> Any:
    from rich import box
    from rich.table import Table

    title = (
        f"KV memory during the continuous runs (pool {result['pool_tokens']} tokens, block "
        f"{result['block_size']}, contiguous slot {result['slot_tokens']}, context {result['context']})"
    )
    table = Table(title=title, caption=KV_CAPTION, box=box.SIMPLE_HEAD)
    for col in KV_COLUMNS:
        table.add_column(col, justify="right")
    for level in result["levels"]:
        kv = level["kv"]
        peak = kv["peak_tokens"].get("allocated", 0) / result["pool_tokens"]
        table.add_row(
            str(level["concurrency"]),
            f"{kv['internal_waste']:.1%}",
            f"{peak:.0%}",
            f"{kv['contiguous_used_over_reserved_max_tokens']:.1%}",
            f"{kv['contiguous_used_over_reserved_context']:.1%}",
            str(kv["contiguous_max_num_seqs"]),
        )
    return table
