"""`localllm bench serve` (load generator against an OpenAI-compatible server) and `localllm bench batching`
(continuous vs static batching, paged vs contiguous KV, in-process).

bench.py registers these commands on its `bench` group; this module does not import bench.py back.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from localllm.cli import common as c

ModelArg = Annotated[
    str | None, typer.Argument(help="A .gguf path or registry name. [default: the default model]")
]
Concurrency = Annotated[str, typer.Option("--concurrency", help="Concurrency levels, comma-separated.")]
JsonOut = Annotated[
    Path | None, typer.Option("--json", help="Also write the results (and system info) here.")
]
PlotOut = Annotated[Path | None, typer.Option("--plot", help="Write a PNG: throughput and latency CDF.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the workload.")]
Url = Annotated[str | None, typer.Option("--url", help="Benchmark this server instead of starting one.")]
DatasetPath = Annotated[Path | None, typer.Option("--dataset-path", help="JSONL: prompt, max_tokens.")]
RequestRate = Annotated[float, typer.Option("--request-rate", help="Poisson arrivals, req/s; inf = at once.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Exact output lengths.")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="Bearer key.")]
Parallel = Annotated[int, typer.Option("--parallel", help="Server slots (0 = the highest concurrency).")]
EngineCtx = Annotated[int, typer.Option("--ctx-size", help="Engine context (0 = the longest request).")]
ServerArgs = Annotated[str, typer.Option("--server-args", help="More `localllm serve` flags, quoted.")]


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter("concurrency levels must be integers >= 1")
    return levels


def _write_json(path: Path | None, obj: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"results written to {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ serve


def serve(
    model: ModelArg = None,
    url: Url = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="The requests' model field.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="random, prefix or jsonl.")] = "random",
    dataset_path: DatasetPath = None,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens (approximately).")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="max_tokens per request.")] = 64,
    range_ratio: Annotated[float, typer.Option("--random-range-ratio", help="Lengths vary +-ratio.")] = 0.0,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="Shared prefix tokens (prefix).")] = 256,
    num_prompts: Annotated[int, typer.Option("--num-prompts", "-n", help="Requests per level.")] = 32,
    concurrency: Concurrency = "1,4,16",
    request_rate: RequestRate = math.inf,
    ignore_eos: IgnoreEos = True,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed per request.")] = 600.0,
    api_key: ApiKey = None,
    backend: c.Backend = "numba",
    threads: c.Threads = 0,
    parallel: Parallel = 0,
    ctx_size: c.CtxSize = 0,
    server_args: ServerArgs = "",
    seed: Seed = 0,
    json_out: JsonOut = None,
    plot: PlotOut = None,
) -> None:
    """Load-test an OpenAI-compatible server and report vLLM's serving metrics per concurrency level.

    Without --url it starts `localllm serve MODEL` on a free loopback port and stops it afterwards.

    Examples:

      localllm bench serve smollm2-135m-instruct -c 1,4,16 --num-prompts 64

      localllm bench serve model.gguf --dataset prefix --prefix-len 512 --input-len 64

      localllm bench serve --url http://127.0.0.1:8080 --request-rate 2 --json llama-server.json
    """
    _serve_command(SimpleNamespace(**locals()))


def _serve_command(o: SimpleNamespace) -> None:
    from localllm.bench import serving

    levels = _levels(o.concurrency)
    _check_serve_flags(o.dataset, o.dataset_path, o.plot)
    shape = {
        "dataset": o.dataset,
        "num_prompts": o.num_prompts,
        "input_len": o.input_len,
        "output_len": o.output_len,
        "random_range_ratio": o.range_ratio,
        "prefix_len": o.prefix_len if o.dataset == "prefix" else 0,
        "seed": o.seed,
        "dataset_path": str(o.dataset_path) if o.dataset_path else None,
    }
    launch = (o.backend, o.threads, o.parallel or max(levels), o.ctx_size, o.server_args)
    with _target(o.url, o.model, launch) as (base, path):
        load = serving.LoadConfig(
            base, "", levels, o.request_rate, o.ignore_eos, o.timeout, o.api_key, o.seed
        )
        load.model = o.model_name or serving.model_name(base, load.headers, path.stem if path else "default")
        tpw = _tokens_per_word(serving, load) if o.dataset != "jsonl" else None
        results = serving.run_sweep(load, _serve_workload(serving, shape, tpw or 1.0))
        spec = serving.spec_counts(base, load.headers)  # a localllm server's, over the whole sweep
    info = _serve_info(o.url, base, path, o.backend, o.threads, load.model, tpw)
    if spec is not None:
        info["speculative"] = spec
    serving.print_serving(results, info)
    config = {**shape, "request_rate": serving.json_rate(o.request_rate), "ignore_eos": o.ignore_eos}
    _write_json(o.json_out, {"system": info, "config": config, "results": results})
    if o.plot is not None:
        from localllm.bench.plots import plot_serving

        print(f"plot written to {plot_serving(results, info, o.plot)}", file=sys.stderr)


def _check_serve_flags(dataset: str, dataset_path: Path | None, plot: Path | None) -> None:
    """Fail before anything starts, not after a long run."""
    if dataset not in ("random", "prefix", "jsonl"):
        raise typer.BadParameter(f"--dataset must be random, prefix or jsonl, not {dataset!r}")
    if dataset == "jsonl" and dataset_path is None:
        raise typer.BadParameter("--dataset jsonl needs --dataset-path FILE")
    if plot is not None:
        from localllm.bench.plots import require_matplotlib

        require_matplotlib()


@contextmanager
def _target(url: str | None, model: str | None, launch: tuple) -> Iterator[tuple[str, Path | None]]:
    """The server root to load, and the model file when we know it (for its sha256)."""
    from localllm.bench import server_process, serving

    if url:
        local = Path(model) if model and Path(model).is_file() else None
        yield serving.base_url(url), local
        return
    import shlex

    backend, threads, parallel, ctx_size, extra = launch
    path, _ = c.resolve(model)

    def command(port: int) -> list[str]:
        return server_process.serve_command(
            path, port, backend, threads, parallel, ctx_size, shlex.split(extra)
        )

    print(
        f"starting localllm serve {path.name} (backend {backend}, parallel {parallel}) ...", file=sys.stderr
    )
    with server_process.local_server(command) as base:
        yield base, path


def _tokens_per_word(serving: Any, load: Any) -> float | None:
    tpw = serving.tokens_per_word(load.url, load.model, load.headers)
    if tpw is None:
        print("warning: the probe request got no usage back; assuming one token per word", file=sys.stderr)
    return tpw


def _serve_workload(serving: Any, shape: dict[str, Any], tpw: float) -> Callable[[int], list]:
    """The prompts of each concurrency level (a JSONL file is read once, before anything is sent)."""
    n, out_len = shape["num_prompts"], shape["output_len"]
    if shape["dataset"] == "jsonl":
        specs = serving.jsonl_workload(Path(shape["dataset_path"]), n, out_len)
        return lambda level: specs
    args = (
        n,
        shape["input_len"],
        out_len,
        shape["random_range_ratio"],
        tpw,
        shape["prefix_len"],
        shape["seed"],
    )
    return lambda level: serving.synthetic_workload(*args, level)


def _serve_info(
    url: str | None, base: str, path: Path | None, backend: str, threads: int, model: str, tpw: float | None
) -> dict[str, Any]:
    """system_info of this machine; for --url the server's backend is not ours to know."""
    from localllm.bench.system import system_info

    info = system_info(path, "external" if url else backend, threads or _cores())
    info.update(
        target=url or f"localllm serve ({backend})", server_url=base, model_name=model, tokens_per_word=tpw
    )
    return info


def _cores() -> int:
    from localllm.config import physical_cores

    return physical_cores()


# ------------------------------------------------------------------------------------------------ batching


def batching(
    model: ModelArg = None,
    num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Requests in the workload.")] = 32,
    input_len: Annotated[str, typer.Option("--input-len", help="Prompt tokens: N or MIN:MAX.")] = "64:512",
    output_len: Annotated[
        str, typer.Option("--output-len", help="Generated tokens: N or MIN:MAX.")
    ] = "16:128",
    concurrency: Concurrency = "1,4,16",
    kv_tokens: Annotated[int, typer.Option("--kv-tokens", help="KV pool in tokens (0 = sized for it).")] = 0,
    ctx_size: EngineCtx = 0,
    backend: c.Backend = "numba",
    threads: c.Threads = 0,
    seed: Seed = 0,
    json_out: JsonOut = None,
    plot: PlotOut = None,
) -> None:
    """Compare continuous with static batching, and paged with contiguous KV, on one engine in-process.

    Examples:

      localllm bench batching smollm2-135m-instruct

      localllm bench batching model.gguf -c 1,8,32 -n 64 --input-len 32:1024 --output-len 8:256 --plot b.png
    """
    from localllm.bench import batching as b

    levels, ins, outs = _levels(concurrency), b.parse_range(input_len), b.parse_range(output_len)
    if num_requests < 1:
        raise typer.BadParameter("--num-requests must be >= 1")
    if plot is not None:
        from localllm.bench.plots import require_matplotlib

        require_matplotlib()
    path, _ = c.resolve(model)
    engine = b.make_engine(
        path, backend, threads, ins, outs, max(levels), kv_tokens, ctx_size, c.model_home() / "index"
    )
    workload = b.make_workload(engine.args.vocab_size, num_requests, ins, outs, seed)
    result = b.compare(engine, workload, levels, _level_done)
    info = _batching_info(path, backend, engine)
    b.print_batching(result, info)
    config = {
        "num_requests": num_requests,
        "input_len": list(ins),
        "output_len": list(outs),
        "seed": seed,
        "prompt_tokens": sum(map(len, workload.prompts)),
        "output_tokens": sum(workload.max_tokens),
    }
    _write_json(json_out, {"system": info, "config": config, **result})
    if plot is not None:
        from localllm.bench.plots import plot_batching

        print(f"plot written to {plot_batching(result, info, plot)}", file=sys.stderr)


def _level_done(concurrency: int) -> None:
    print(f"concurrency {concurrency}: continuous, static and contiguous runs done", file=sys.stderr)


def _batching_info(path: Path, backend: str, engine: Any) -> dict[str, Any]:
    from localllm.bench.system import system_info

    info = system_info(path, backend, engine.config.num_threads)
    info["target"] = f"in-process LLMEngine ({path.name})"
    return info
