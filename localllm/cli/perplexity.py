"""`localllm perplexity`: how well a model predicts a text, measured as llama-perplexity measures it."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from localllm.cli import common as c
from localllm.cli.app import app
from localllm.errors import LocalLLMError


@app.command()
def perplexity(
    model: Annotated[str, typer.Argument(help="A .gguf path or registry name.")],
    file: Annotated[str, typer.Argument(help="The UTF-8 text to score (e.g. wikitext-2's test set).")],
    ctx_size: Annotated[
        int, typer.Option("--ctx-size", "-c", help="Tokens per chunk; the second half of each is scored.")
    ] = 512,
    chunks: Annotated[int, typer.Option("--chunks", help="Score at most N chunks (-1 = all).")] = -1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the result.")] = False,
    save_logits: Annotated[
        str | None,
        typer.Option("--save-logits", help="Save the scored log-probabilities (a base for --kl-divergence)."),
    ] = None,
    kl_divergence: Annotated[
        str | None,
        typer.Option(
            "--kl-divergence",
            metavar="BASE_LOGITS",
            help="Compare with a base model's --save-logits file (also llama-perplexity's): KLD, Δppl, "
            "same top token. FILE is then not read ('-' will do).",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite the --save-logits file.")] = False,
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
    _perplexity_command(SimpleNamespace(**locals()))


def _perplexity_command(o: SimpleNamespace) -> None:
    from localllm.engine.engine import LLMEngine

    if o.save_logits and o.kl_divergence:
        raise LocalLLMError("--save-logits and --kl-divergence go in separate runs (base, then model)")
    text = _text(o.file, o.save_logits, o.force) if not o.kl_divergence else ""
    o.ctx_size = _base_ctx(o.kl_divergence) if o.kl_divergence else o.ctx_size
    path, defaults = c.resolve(o.model, o.backend, o.threads, (o.cache_type_k, o.cache_type_v))
    # The engine's context is a cap that a prompt must stay under, so a full chunk needs one more.
    config = c.engine_config(
        path, o.backend, o.threads, o.ctx_size + 1, defaults, max_num_seqs=1, enable_prefix_caching=False,
        cache_type_k=o.cache_type_k, cache_type_v=o.cache_type_v, device=o.device,
    )  # fmt: skip
    with c.loading(o.backend, path):
        engine = LLMEngine(config)
    if o.kl_divergence:
        _run_kld(engine, path, o.kl_divergence, o.chunks, o.as_json)
        return
    from localllm.perplexity import perplexity as compute

    with _Progress(quiet=o.as_json) as on_chunk:
        result = compute(engine, text, o.ctx_size, o.chunks, on_chunk, o.save_logits)
    if o.as_json:
        print(json.dumps({"model": str(path), "file": o.file, **result.as_dict()}))
        return
    print(
        f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f} "
        f"({result.n_chunks} chunks of {result.n_ctx} tokens, {result.n_scored} scored, "
        f"{result.n_chunks * result.n_ctx / result.seconds:.1f} tok/s)"
    )


def _text(file: str, save_logits: str | None, force: bool) -> str:
    """The text, read before the load: a missing file (or a --save-logits one in the way) fails at once."""
    from pathlib import Path

    from localllm.perplexity import read_text

    if save_logits and Path(save_logits).exists() and not force:
        raise LocalLLMError(f"{save_logits} exists; pass --force to overwrite it")
    return read_text(file)


def _base_ctx(base_logits: str) -> int:
    """The chunk size the base's logits were saved with (a KLD run scores the same chunks)."""
    from localllm.logits_file import LogitsReader

    reader = LogitsReader(base_logits)
    reader.close()
    return reader.n_ctx


def _run_kld(engine: Any, path: Any, base_logits: str, chunks: int, as_json: bool) -> None:
    from localllm.perplexity import kl_divergence

    with _Progress(quiet=as_json) as on_chunk:
        r = kl_divergence(engine, base_logits, chunks, on_chunk)
    if as_json:
        print(json.dumps({"model": str(path), "base_logits": base_logits, **r}))
        return
    print(
        f"PPL(Q) = {r['ppl']:.4f} +/- {r['ppl_stderr']:.5f}, PPL(base) = {r['ppl_base']:.4f} "
        f"+/- {r['ppl_base_stderr']:.5f}, PPL(Q)-PPL(base) = {r['ppl_diff']:.4f} "
        f"+/- {r['ppl_diff_stderr']:.5f}\n"
        f"KLD: mean {r['kld_mean']:.6f} +/- {r['kld_stderr']:.6f}, median {r['kld_median']:.6f}, "
        f"99% {r['kld_p99']:.6f}, max {r['kld_max']:.6f}\n"
        f"Same top token: {100 * r['same_top_p']:.3f} +/- {100 * r['same_top_p_stderr']:.3f} %, "
        f"RMS Δp {100 * r['p_diff_rms']:.3f} %  ({r['count']} tokens in {r['n_chunks']} chunks)"
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
        if hasattr(stats, "kld"):
            estimate += f", KLD {stats.kld:.5f}"
        self.bar.update(self.task, completed=done, total=total, description=estimate)
        if self.plain:
            print(f"[{done}/{total}] {estimate}", file=sys.stderr, flush=True)
