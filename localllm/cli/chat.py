"""`localllm chat`: talk with a model in the terminal (the work lives in localllm.chat)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

from localllm.cli import common as c
from localllm.cli.app import app
from localllm.config import DRAFT_VOCAB
from localllm.sampling_params import CHAT_MAX_TOKENS

HINT = (
    "pass --chat-template with a Jinja template, a template file or 'chatml', or use "
    "`localllm run --raw` for plain completion"
)


@app.command()
def chat(
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="[MODEL]", help="A .gguf path or registry name; the default model if omitted."
        ),
    ] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    chat_template: c.ChatTemplateOption = None,
    temperature: c.Temperature = None,
    top_p: c.TopP = None,
    top_k: c.TopK = None,
    min_p: c.MinP = None,
    repeat_penalty: c.RepeatPenalty = None,
    presence_penalty: c.PresencePenalty = 0.0,
    frequency_penalty: c.FrequencyPenalty = 0.0,
    seed: c.Seed = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            "-n",
            help=f"Most tokens per reply (default {CHAT_MAX_TOKENS}, or the model's; -1 = until the context "
            "is full); /set max_tokens changes it.",
        ),
    ] = None,
    stop: c.Stop = None,
    loop_guard: c.LoopGuard = True,
    json_schema: c.JsonSchemaFile = None,
    grammar: c.GrammarFile = None,
    reasoning_budget: c.ReasoningBudget = None,
    threads: c.Threads = 0,
    ctx_size: c.CtxSize = 0,
    backend: c.Backend = "numba",
    device: c.Device = "auto",
    cache_type_k: c.CacheTypeK = "f16",
    cache_type_v: c.CacheTypeV = "f16",
    prompt_lookup: c.PromptLookup = False,
    draft_model: c.DraftModel = None,
    draft_max: c.DraftMax = 8,
    draft_vocab: c.DraftVocab = DRAFT_VOCAB,
) -> None:
    """Chat with a model in the terminal, replies streamed as they are written.

    The conversation and its KV cache carry across turns, so each turn only processes the new text;
    when the context fills up the oldest turns are dropped (never the system prompt), with a notice.
    Type /help inside for commands; Ctrl-C stops a reply, Ctrl-D leaves. With stdin not a terminal, all
    of stdin is one message: the reply goes to stdout, stats to stderr.

    Examples:

      localllm chat

      localllm chat smollm2-135m-instruct --system "Answer in one sentence." --temperature 0.3

      echo "Why is the sky blue?" | localllm chat

      localllm chat base-model.gguf --chat-template chatml
    """
    _chat_command(SimpleNamespace(**locals()))


def _chat_command(o: SimpleNamespace) -> None:
    from localllm.chat.session import ChatSession
    from localllm.engine.async_engine import AsyncEngine
    from localllm.loading.file import GGUFFile
    from localllm.reasoning import with_reasoning
    from localllm.sampling_params import CHAT_DEFAULTS
    from localllm.tokenizer.chat_template import require_chat_template

    flags = c.sampling_flags(vars(o))
    flags["structured"] = c.structured_spec(o.json_schema, o.grammar)
    interactive = sys.stdin.isatty()
    path, defaults = c.resolve(o.model, o.backend, o.threads, (o.cache_type_k, o.cache_type_v))
    spec = c.spec_options(o.prompt_lookup, o.draft_model, o.draft_max, o.draft_vocab)
    metadata = GGUFFile.open(path, c.model_home() / "index").metadata  # cheap: the cached index
    # Refuse a model without a template now, before the load.
    template = require_chat_template(
        metadata, path.name, o.chat_template, defaults.get("chat_template"), HINT
    )
    config = c.engine_config(
        path, o.backend, o.threads, o.ctx_size, defaults, max_num_seqs=1, cache_type_k=o.cache_type_k,
        cache_type_v=o.cache_type_v, device=o.device, **spec,
    )  # fmt: skip
    engine = _load(config, interactive)
    params = c.sampling_params(engine, flags, CHAT_DEFAULTS)  # to the end of its turn, or the limit
    params = with_reasoning(params, template, engine.tokenizer, o.reasoning_budget)
    session = ChatSession(
        engine.tokenizer, template, engine.max_model_len, o.system or defaults.get("system")
    )
    runner = AsyncEngine(engine)
    counter = iter(range(1 << 62))

    def stream(ids, p):
        return runner.stream(ids, p, f"chat-{next(counter)}")

    try:
        if interactive:
            _interactive(session, stream, params, path, o.backend, engine.max_model_len)
        else:
            from localllm.chat.repl import answer_once

            answer_once(session, stream, params, sys.stdin.read(), sys.stdout, sys.stderr)
    finally:
        runner.shutdown()


def _load(config, interactive: bool):
    """The engine, under a spinner on a terminal."""
    from localllm.engine.engine import LLMEngine

    model = Path(config.model)
    if not interactive:
        with c.loading(config.backend, model):
            return LLMEngine(config)
    from rich.console import Console

    with c.loading(config.backend, model), Console(stderr=True).status(f"loading {model.name} ..."):
        return LLMEngine(config)


def _interactive(session, stream, params, path, backend: str, ctx: int) -> None:
    from rich.console import Console

    from localllm.chat.repl import ChatRepl, plain_reader, prompt_toolkit_reader

    console = Console(highlight=False)
    terminal = sys.stdout.isatty()
    read = prompt_toolkit_reader(c.model_home() / "chat_history") if terminal else plain_reader
    about = {"model": path.name, "context": f"{ctx} tokens", "backend": backend}
    ChatRepl(session, stream, params, console, read, about, live=terminal).run()
