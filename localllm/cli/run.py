"""`localllm run`: one prompt in, the completion streamed out."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Annotated

import typer

from localllm.cli import common as c
from localllm.cli.app import app
from localllm.config import DRAFT_VOCAB


@app.command()
def run(
    args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[MODEL] PROMPT",
            help="A .gguf path, Hugging Face directory or registry name (optional), then the prompt.",
        ),
    ] = None,
    chat: Annotated[bool, typer.Option("--chat/--raw", help="Apply the model's chat template.")] = True,
    system: Annotated[str | None, typer.Option("--system", help="System prompt (chat mode).")] = None,
    chat_template: c.ChatTemplateOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of streaming.")
    ] = False,
    temperature: c.Temperature = None,
    top_p: c.TopP = None,
    top_k: c.TopK = None,
    min_p: c.MinP = None,
    repeat_penalty: c.RepeatPenalty = None,
    presence_penalty: c.PresencePenalty = 0.0,
    frequency_penalty: c.FrequencyPenalty = 0.0,
    seed: c.Seed = None,
    max_tokens: c.MaxTokens = None,
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
    kv_disk_mb: c.KvDiskMb = None,
    kv_disk_dir: c.KvDiskDir = None,
    quantize: c.Quantize = None,
    group_size: c.GroupSize = 32,
    prompt_lookup: c.PromptLookup = False,
    draft_model: c.DraftModel = None,
    draft_max: c.DraftMax = 8,
    draft_vocab: c.DraftVocab = DRAFT_VOCAB,
) -> None:
    """Generate a completion for PROMPT and stream it to stdout; stats go to stderr.

    Examples:

      localllm run "Why is the sky blue?"

      localllm run smollm2-135m-instruct "Write a haiku" --temperature 0 -n 64

      localllm run base-model.gguf "Write a haiku" --chat-template chatml

      localllm run ./Qwen2.5-0.5B-Instruct "Write a haiku" --quantize int4

    A thinking model's reasoning (Qwen3's <think> block, gpt-oss's analysis channel) goes to stderr,
    dimmed, and the answer to stdout; --json reports it apart as "reasoning".
    """
    _run_command(SimpleNamespace(**locals()))


def _run_command(o: SimpleNamespace) -> None:
    from localllm.chat.display import ThinkingWriter
    from localllm.engine.engine import LLMEngine
    from localllm.reasoning import with_reasoning
    from localllm.tokenizer.chat_template import chat_template_source

    flags = c.sampling_flags(vars(o))
    flags["structured"] = c.structured_spec(o.json_schema, o.grammar)
    model, prompt = _model_and_prompt(o.args or [])
    path, defaults = c.resolve(
        model, o.backend, o.threads, (o.cache_type_k, o.cache_type_v), o.quantize, o.group_size
    )
    spec = c.spec_options(o.prompt_lookup, o.draft_model, o.draft_max, o.draft_vocab)
    spec |= c.one_shot_cache_options(o.kv_disk_mb, o.kv_disk_dir)
    template = chat_template_source(o.chat_template, defaults.get("chat_template")) if o.chat else None
    config = c.engine_config(
        path, o.backend, o.threads, o.ctx_size, defaults, max_num_seqs=1, cache_type_k=o.cache_type_k,
        cache_type_v=o.cache_type_v, device=o.device, **spec,
    )  # fmt: skip
    with c.loading(o.backend, path):
        engine = LLMEngine(config)
    params = c.sampling_params(engine, flags)
    chat_template = _template(engine, o.chat, template)
    prompt_ids = _prompt_ids(engine, prompt, o.system or defaults.get("system"), chat_template)
    params = with_reasoning(params, chat_template, engine.tokenizer, o.reasoning_budget)
    outputs = []
    thinking = ThinkingWriter(sys.stderr)  # the reasoning apart from the answer, on stderr
    for out in engine.stream(prompt_ids, params):
        outputs.append(out)
        if not o.as_json:
            thinking.write(out.reasoning, bool(out.text))
            sys.stdout.write(out.text)
            sys.stdout.flush()
    thinking.close()
    _report(outputs, prompt_ids, o.as_json, engine.spec.stats if engine.spec else None)


def _model_and_prompt(args: list[str]) -> tuple[str | None, str]:
    from localllm.cli.help import UsageProblem

    if not args:
        raise UsageProblem('give a prompt: localllm run "Why is the sky blue?" (or: run MODEL "PROMPT")')
    if len(args) > 2:
        raise UsageProblem(f'expected [MODEL] PROMPT, got {len(args)} words: quote the prompt, "like this"')
    return (args[0], args[1]) if len(args) == 2 else (None, args[0])


def _template(engine, chat: bool, source: str | None):
    """The chat template (None with --raw, or for a model with no template at all)."""
    from localllm.tokenizer.chat_template import resolve_chat_template

    return resolve_chat_template(engine.gguf.metadata, configured=source) if chat else None


def _prompt_ids(engine, prompt: str, system: str | None, template) -> list[int]:
    """The chat-templated prompt; the raw prompt without a template."""
    from localllm.tokenizer.chat_template import apply_chat_template

    if template is None:
        return engine.tokenize_prompt(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return apply_chat_template(engine.tokenizer, template, messages)


def _report(outputs: list, prompt_ids: list[int], as_json: bool, spec=None) -> None:
    from localllm.engine.engine import collect_request_output

    result = collect_request_output("run", prompt_ids, outputs)
    if as_json:
        print(json.dumps(_as_dict(result, spec), ensure_ascii=False))
        return
    sys.stdout.write("\n")
    if result.finish_reason == "repetition":
        from localllm.engine.loop_guard import loop_notice

        print(loop_notice(result.generated_tokens), file=sys.stderr)
    print(
        f"prompt: {result.prompt_tokens} tokens ({result.cached_tokens} cached), "
        f"{result.prefill_tokens_per_s:.1f} tok/s | generated: {result.generated_tokens} tokens, "
        f"{result.decode_tokens_per_s:.1f} tok/s | finish: {result.finish_reason}"
        + (f" | {spec.summary()}" if spec is not None else ""),
        file=sys.stderr,
    )


def _as_dict(result, spec=None) -> dict:
    extra = {"speculative": spec.as_dict()} if spec is not None else {}
    return {
        "text": result.text,
        "reasoning": result.reasoning,  # a thinking model's thinking, kept out of "text"
        "reasoning_tokens": result.reasoning_tokens,
        "token_ids": result.token_ids,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "generated_tokens": result.generated_tokens,
        "finish_reason": result.finish_reason,
        "timings": {
            "ttft_s": result.ttft,
            "total_s": result.elapsed,
            "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "decode_tokens_per_s": result.decode_tokens_per_s,
        },
        **extra,
    }
