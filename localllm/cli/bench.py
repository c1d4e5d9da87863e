"""`localllm bench`: offline llama-bench-style rates; `bench serve` and `bench batching` sub-modes."""

from __future__ import annotations

import gc
import shutil
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from localllm.cli import bench_modes, bench_spec
from localllm.cli import common as c
from localllm.cli.app import app


class _ModelFirstGroup(TyperGroup):
    """Lets `localllm bench MODEL ...` mean `localllm bench --model MODEL ...` next to the sub-modes."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["--model", args[0], *args[1:]]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_ModelFirstGroup, invoke_without_command=True, no_args_is_help=False)
app.add_typer(
    bench_app, name="bench", help="Benchmarks: offline rates, serving load, batching, speculative decoding."
)
bench_app.command("serve")(bench_modes.serve)
bench_app.command("batching")(bench_modes.batching)
bench_app.command("spec")(bench_spec.spec)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _lengths(text: str) -> list[int]:
    """Prompt or generation lengths; 0 skips that test, as in llama-bench."""
    return [n for n in _int_list(text) if n > 0]


@bench_app.callback()
def offline(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="A .gguf path or registry name.")] = None,
    n_prompt: Annotated[
        str, typer.Option("-p", "--n-prompt", help="Prompt lengths, comma-separated.")
    ] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Generation lengths, comma-separated.")] = "128",
    n_depth: Annotated[
        str,
        typer.Option(
            "-d", "--n-depth", help="Context already in the cache before each tgN test, comma-separated."
        ),
    ] = "0",
    threads: Annotated[str, typer.Option("-t", "--threads", help="Thread counts, comma-separated.")] = "",
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Repetitions per test.")] = 3,
    batch: Annotated[str, typer.Option("-b", "--batch", help="Extra decode rows with N sequences.")] = "",
    output: Annotated[
        str, typer.Option("-o", "--output", help="table (tab-separated when piped), md, json, csv or tsv.")
    ] = "table",
    llama_bench: Annotated[
        str | None, typer.Option("--llama-bench", help="llama-bench binary to compare with (or on PATH).")
    ] = None,
    backend: c.Backend = "numba",
    device: c.Device = "auto",
    cache_type_k: c.CacheTypeK = "f16",
    cache_type_v: c.CacheTypeV = "f16",
    busy: Annotated[
        int, typer.Option("--busy", help="Run the tests while N other processes each keep a core busy.")
    ] = 0,
) -> None:
    """Measure prompt processing (ppN) and generation (tgN) speed, like llama-bench.

    Examples:

      localllm bench                       # default model, pp512 and tg128

      localllm bench smollm2-135m-instruct -p 128,512 -n 128 -t 1,2 -r 5 -o md

      localllm bench -b 16 --llama-bench ./llama-bench    # add batched decode, compare with llama.cpp

      localllm bench -n 128 -p 0 --busy 1 --llama-bench ./llama-bench   # both under a competing load

      localllm bench -p 0 -n 64 -d 0,2048 -ctk q8_0 -ctv q8_0   # decode from a q8_0 KV cache
    """
    if ctx.invoked_subcommand is not None:
        return
    from localllm.backends.kv_types import check_cache_type
    from localllm.bench.contention import busy_load, label
    from localllm.bench.offline import BenchPlan, ratios

    kv = (cache_type_k, cache_type_v)
    for t in kv:
        check_cache_type(t)
    path, _ = c.resolve(model, backend, _threads(threads)[0], kv)
    binary = llama_bench or shutil.which("llama-bench")
    plan = BenchPlan(_lengths(n_prompt), _lengths(n_gen), _depths(n_depth), kv)
    with busy_load(busy):
        rows = _run_localllm(path, plan, _threads(threads), reps, _int_list(batch), (backend, device))
        if binary:
            from localllm.bench.offline import run_llama_bench

            for t in _threads(threads):
                rows += run_llama_bench(binary, path, plan, t, reps)
    for row in rows:
        row.test = label(row.test, busy)
    from localllm.bench.report import print_offline
    from localllm.bench.system import system_info

    info = system_info(path, backend, _threads(threads)[0])
    print_offline(rows, ratios(rows), info, output)


def _depths(text: str) -> list[int]:
    """Context depths for the tgN tests; 0 (the default) is an empty cache, as in llama-bench."""
    depths = _int_list(text) or [0]
    if any(d < 0 for d in depths):
        raise typer.BadParameter("depths are 0 or more", param_hint="-d/--n-depth")
    return depths


def _threads(text: str) -> list[int]:
    from localllm.config import physical_cores

    return _int_list(text) or [physical_cores()]


def _run_localllm(path, plan, threads_list, reps, batches, where: tuple[str, str]) -> list:
    """Rows for each thread count; `plan` is an offline.BenchPlan, `where` is (backend, device)."""
    from localllm.bench.offline import OfflineBench
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    rows = []
    n_prompt, n_gen = plan.prompts, plan.gens
    ctx = max(n_prompt + [n + d for n in n_gen for d in plan.depths] + [1]) + max(n_gen + [1]) + 16
    for threads in threads_list:
        config = EngineConfig(
            model=str(path),
            backend=where[0],
            device=where[1],
            threads=threads,
            ctx_size=ctx,
            max_num_seqs=max(batches + [1]),
            max_num_batched_tokens=max(n_prompt + [512]),
            enable_prefix_caching=False,
            index_dir=c.model_home() / "index",
            cache_type_k=plan.kv[0],
            cache_type_v=plan.kv[1],
        )
        engine = LLMEngine(config)
        bench = OfflineBench(engine, reps)
        rows += [bench.prompt_processing(p) for p in n_prompt]
        rows += [bench.text_generation(n, depth=d) for n in n_gen for d in plan.depths]
        rows += [bench.text_generation(n, b) for n in n_gen for b in batches if b > 1]
        print(f"threads={threads}: done", file=sys.stderr)
        # One engine at a time: the next thread count's load would otherwise map the weights a second
        # time beside this one's, and peak RSS (the RSS column, /usr/bin/time) would count both.
        engine.close()
        del bench, engine
        gc.collect()
    return rows
