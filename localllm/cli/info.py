"""`localllm info`: what a GGUF file holds and the memory it needs to run."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from localllm.cli import common as c
from localllm.cli.app import app


@app.command()
def info(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="[MODEL]", help="A .gguf path or registry name; the default model if omitted."
        ),
    ] = None,
    ctx_size: Annotated[
        int,
        typer.Option("--ctx-size", "-c", help="Context length for the KV-cache figure (0 = the model's)."),
    ] = 0,
    full: Annotated[bool, typer.Option("--full", help="Print the whole chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    cache_type_k: c.CacheTypeK = "f16",
    cache_type_v: c.CacheTypeV = "f16",
) -> None:
    """Show a model's metadata, tensor types, chat template and the memory it needs.

    Memory is the file itself (memory-mapped weights) plus the KV cache: f16 keys and values (the default),
    2 x layers x KV heads x head dim x 2 bytes per token of context; q8_0 (-ctk q8_0 -ctv q8_0) takes
    34 bytes per 32 values, 0.53x of f16. "weights on a GPU" is what the torch back end allocates on a
    CUDA device (the block types it keeps quantized, other matrices bf16).
    The last line says whether that (at the context run and serve would use) fits this machine's RAM,
    and when it does not, where to go.

    Examples:

      localllm info smollm2-135m-instruct

      localllm info model.gguf --ctx-size 8192 -ctk q8_0 -ctv q8_0

      localllm info model.gguf --json --full
    """
    from localllm.backends.device_weights import device_weight_bytes
    from localllm.backends.kv_types import check_cache_type
    from localllm.errors import LocalLLMError
    from localllm.loading.file import GGUFFile
    from localllm.model_info import summarize

    if ctx_size < 0:
        raise LocalLLMError("--ctx-size must be >= 0.")
    kv = (cache_type_k, cache_type_v)
    for t in kv:
        check_cache_type(t)
    path, _ = c.resolve(model)
    gf = GGUFFile.open(path, c.model_home() / "index")
    summary = summarize(gf)
    gpu_bytes = device_weight_bytes(gf.tensors.values(), "cuda")  # the torch back end's, quantized
    fit_ctx, fit = machine_fit(summary, ctx_size, kv)
    if as_json:
        data = summary.as_dict(ctx_size or None, kv)
        data["fit"] = {"context": fit_ctx, **dataclasses.asdict(fit)}
        data["memory"]["device_weights_bytes"] = {"cpu": summary.file_size, "cuda": gpu_bytes}
        print(json.dumps(data, ensure_ascii=False, default=str))
        return
    _print(summary, ctx_size or None, full, kv, gpu_bytes, _fit_line(fit_ctx, fit))


def machine_memory() -> tuple[int, int]:
    """(available, total) bytes of RAM on this machine."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def machine_fit(summary, ctx_size: int, kv: tuple[str, str] = ("f16", "f16")):
    """The context run/serve would use (--ctx-size, else the trained one up to DEFAULT_CONTEXT) and
    whether weights, KV cache and runtime at it fit this machine's RAM."""
    from localllm.config import DEFAULT_CONTEXT
    from localllm.model_info import memory_fit

    ctx = ctx_size or min(summary.context_length or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    memory = summary.memory(ctx, kv)
    available, total = machine_memory()
    return ctx, memory_fit(memory["total_bytes"], memory["weights_bytes"], available, total)


def _fit_line(ctx: int, fit):
    from rich.text import Text

    style = {"fits": "green", "tight": "yellow"}.get(fit.verdict, "bold red")
    return Text.assemble((f"this machine @ {ctx:,} tokens of context: ", "bold"), (fit.message, style))


def _print(summary, ctx_size: int | None, full: bool, kv: tuple[str, str], gpu_bytes: int, fit_line) -> None:
    from rich.console import Console

    console = Console()
    parts = (_facts(summary), _tensor_types(summary), _memory(summary, ctx_size, kv, gpu_bytes), fit_line)
    for part in parts:
        console.print(part)
        console.print()
    _print_template(console, summary, full)


def _facts(summary):
    from rich.table import Table
    from rich.text import Text

    from localllm.model_info import format_params, human_bytes
    from localllm.printable import printable

    def n(value) -> str:
        return "?" if value is None else f"{value:,}"

    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    rows = [
        ("name", summary.name),
        ("file", printable(summary.path)),
        ("architecture", summary.architecture),
        ("parameters", f"{format_params(summary.parameters)} ({summary.parameters:,})"),
        ("file size", f"{human_bytes(summary.file_size)} ({summary.file_size:,} bytes)"),
        ("quantization", summary.quant or "?"),
        ("context length", n(summary.context_length)),
        ("embedding", n(summary.embedding_length)),
        ("layers", n(summary.n_layers)),
        ("heads", f"{n(summary.n_heads)} (KV heads {n(summary.n_kv_heads)}, head dim {n(summary.head_dim)})"),
        ("vocabulary", f"{n(summary.vocab_size)} ({summary.tokenizer or '?'} tokenizer)"),
    ]
    rows += [(key.replace("_", " "), str(value)) for key, value in summary.extra.items()]
    for key, value in rows:
        facts.add_row(key, Text(value))
    return facts


def _tensor_types(summary):
    from rich.table import Table

    from localllm.model_info import human_bytes

    types = Table(title="tensor types", title_justify="left", box=None, header_style="bold")
    for column in ("TYPE", "TENSORS", "PARAMETERS", "SIZE", "SHARE"):
        types.add_column(column, justify="left" if column == "TYPE" else "right")
    total = sum(t.bytes for t in summary.tensor_types) or 1
    for t in summary.tensor_types:
        types.add_row(
            t.type, str(t.count), f"{t.parameters:,}", human_bytes(t.bytes), f"{100 * t.bytes / total:.1f}%"
        )
    return types


def _memory(summary, ctx_size: int | None, kv: tuple[str, str], gpu_bytes: int):
    from rich.table import Table

    from localllm.model_info import human_bytes

    memory = summary.memory(ctx_size, kv)
    mem = Table(title="memory", title_justify="left", box=None, header_style="bold", show_header=False)
    mem.add_column(style="bold")
    mem.add_column(justify="right")
    mem.add_column()
    mem.add_row("weights", human_bytes(memory["weights_bytes"]), "the file, memory-mapped (CPU)")
    mem.add_row("weights on a GPU", human_bytes(gpu_bytes), "--backend torch: block types kept, others bf16")
    per_token = memory["kv_bytes_per_token"]
    if per_token is None:
        mem.add_row("KV cache", "?", "the metadata lacks layer or head counts")
        return mem
    layers = summary.n_layers - summary.recurrent_layers  # a hybrid's recurrent layers keep no KV
    heads = f"{summary.n_kv_heads} KV heads x {summary.head_dim}"
    shape = f"2 x {layers} layers x {heads} x {_element(kv)}"
    mem.add_row("KV cache / token", human_bytes(per_token), shape)
    at_ctx = f"KV cache @ {memory['context']:,}"
    mem.add_row(at_ctx, human_bytes(memory["kv_cache_bytes"]), "tokens of context")
    if memory.get("state_pool_bytes"):
        layers = f"{summary.recurrent_layers} recurrent layers' conv window and delta-rule state (f32)"
        mem.add_row("state / sequence", human_bytes(memory["state_bytes_per_sequence"]), layers)
        slots = f"state pool x {memory['state_slots']}"
        mem.add_row(
            slots,
            human_bytes(memory["state_pool_bytes"]),
            "16 sequences (--parallel), 1 for scoring, 8 prefix snapshots",
        )
    chunk = f"Python, Numba, kernels; a {memory['prompt_chunk']:,}-token prompt chunk"
    mem.add_row("runtime (CPU)", human_bytes(memory["runtime_bytes"]), chunk)
    mem.add_row("total", human_bytes(memory["total_bytes"]), "")
    return mem


def _element(kv: tuple[str, str]) -> str:
    """What one cached value takes: "2 B (f16)", "34/32 B (q8_0)", or both of K's and V's."""
    from localllm.backends.kv_types import CACHE_TYPE_BLOCKS

    def one(t: str) -> str:
        values, nbytes = CACHE_TYPE_BLOCKS[t]
        return f"{nbytes if values == 1 else f'{nbytes}/{values}'} B ({t})"

    return one(kv[0]) if kv[0] == kv[1] else f"(K {one(kv[0])} + V {one(kv[1])}) / 2"


def _print_template(console, summary, full: bool) -> None:
    from rich.text import Text

    from localllm.model_info import short_template

    if summary.chat_template is None:
        console.print("[bold]chat template[/bold]: none (a base model? `chat` needs --chat-template)")
        return
    text, cut = (summary.chat_template, False) if full else short_template(summary.chat_template)
    console.print(f"[bold]chat template[/bold] ({len(summary.chat_template):,} characters):")
    console.print(Text(text), soft_wrap=True)
    if cut:
        console.print("[dim]... (shortened; --full prints all of it)[/dim]")
