"""`localllm perplexity`: how well a model predicts a text, measured as llama-perplexity measures it."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from localllm.cli import common as c
from localllm.cli.app import app


@app.command()
def perplexity(
    model: Annotated[str, typer.Argument(help="A .gguf path or registry name.")],
    file: Annotated[str, typer.Argument(help="The UTF-8 text to score (e.g. wikitext-2's test set).")],
    ctx_size: Annotated[
        int, typer.Option("--ctx-size", "-c", help="Tokens per chunk; the second half of each is scored.")
    ] = 512,
    chunks: Annotated[int, typer.Option("--chunks", help="Score at most N chunks (-1 = all).")] = -1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the result.")] = False,
    threads: c.Threads = 0,
    backend: c.Backend = "numba",
    device: c.Device = "auto",
    cache_type_k: c.CacheTypeK = "f16",
    cache_type_v: c.CacheTypeV = "f16",
) -> None:
    """Perplexity of MODEL on the text in FILE, computed as llama.cpp's llama-perplexity does.

    Chunks of --ctx-size tokens, each scored from an empty cache on its second half.

    The result is exp(mean negative log-likelihood) +/- its standard error.

    Examples:

      localllm perplexity smollm2-135m-instruct wiki.test.raw

      localllm perplexity model.Q4_0.gguf wiki.test.raw -c 512 --chunks 20 --json
    """
    from localllm.engine.engine import LLMEngine
    from localllm.perplexity import perplexity as compute
    from localllm.perplexity import read_text

    text = read_text(file)  # before the load: a missing file is a one-line error, at once
    path, defaults = c.resolve(model, backend, threads, (cache_type_k, cache_type_v))
    # The engine's context is a cap that a prompt must stay under, so a full chunk needs one more.
    config = c.engine_config(
        path, backend, threads, ctx_size + 1, defaults, max_num_seqs=1, enable_prefix_caching=False,
        cache_type_k=cache_type_k, cache_type_v=cache_type_v, device=device,
    )  # fmt: skip
    with c.loading(backend, path):
        engine = LLMEngine(config)
    with _Progress(quiet=as_json) as on_chunk:
        result = compute(engine, text, ctx_size, chunks, on_chunk)
    if as_json:
        print(json.dumps({"model": str(path), "file": file, **result.as_dict()}))
        return
    print(
        f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f} "
        f"({result.n_chunks} chunks of {result.n_ctx} tokens, {result.n_scored} scored, "
        f"{result.n_chunks * result.n_ctx / result.seconds:.1f} tok/s)"
    )


class _Progress:
    """A rich progress bar on stderr with the running estimate when stderr is a terminal; else, unless
    `quiet`, one plain line per chunk (as llama-perplexity prints `[1]12.3456,`)."""

    def __init__(self, quiet: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self.plain = not console.is_terminal and not quiet
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        self.bar = Progress(*columns, console=console, disable=not console.is_terminal)
        self.task = self.bar.add_task("perplexity", total=None)

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def __call__(self, done: int, total: int, stats: Any) -> None:
        estimate = f"PPL {stats.ppl:.4f} ± {stats.ppl_stderr:.4f}"
        self.bar.update(self.task, completed=done, total=total, description=estimate)
        if self.plain:
            print(f"[{done}/{total}] {estimate}", file=sys.stderr, flush=True)
