"""`localllm bench spec`: speculative decoding on and off, interleaved on one engine (see bench/spec.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from localllm.cli import common as c
from localllm.config import DRAFT_VOCAB

Workload = Annotated[
    str | None,
    typer.Option(
        "--workload",
        help="edit (rewrite code from the prompt), code (raw completion) or creative (stories). "
        "[default: edit with --prompt-lookup, code with --draft-model]",
    ),
]


def spec(
    model: Annotated[str | None, typer.Argument(help="A .gguf path or registry name.")] = None,
    prompt_lookup: c.PromptLookup = False,
    draft_model: c.DraftModel = None,
    draft_max: c.DraftMax = 8,
    draft_vocab: c.DraftVocab = DRAFT_VOCAB,
    workload: Workload = None,
    n_gen: Annotated[int, typer.Option("-n", "--n-gen", help="Tokens generated per prompt.")] = 128,
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts in the workload (1-8).")] = 2,
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Timed runs of each mode.")] = 3,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests decoded together.")] = 1,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="[default: 1 for creative, else 0 (greedy)]")
    ] = None,
    threads: c.Threads = 0,
    backend: c.Backend = "numba",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results here.")] = None,
) -> None:
    """Decode speed with speculative decoding off and on, alternating on one engine, same run.

    Examples:

      localllm bench spec qwen2.5-coder-0.5b-instruct --prompt-lookup

      localllm bench spec qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct

      localllm bench spec qwen2.5-coder-0.5b-instruct --prompt-lookup --workload creative

      localllm bench spec qwen2.5-coder-0.5b-instruct --prompt-lookup --concurrency 8 --prompts 4
    """
    from localllm.bench import spec as s
    from localllm.engine.engine import LLMEngine
    from localllm.sampling_params import SamplingParams

    options = c.spec_options(prompt_lookup, draft_model, draft_max, draft_vocab)
    if not (prompt_lookup or draft_model):
        raise typer.BadParameter("give --prompt-lookup or --draft-model NAME|PATH to compare with")
    workload = workload or ("edit" if prompt_lookup else "code")
    if workload not in s.WORKLOADS:
        raise typer.BadParameter(f"--workload must be one of {', '.join(s.WORKLOADS)}, not {workload!r}")
    path, _ = c.resolve(model)
    config = c.engine_config(path, backend, threads, 4096, max_num_seqs=concurrency, **options)
    with c.loading(backend, path):
        engine = LLMEngine(config)
    temp = temperature if temperature is not None else (1.0 if workload == "creative" else 0.0)
    params = SamplingParams(temperature=temp, top_p=1.0, max_tokens=n_gen, ignore_eos=True, seed=0)
    ids = s.workload_prompts(engine, workload, max(1, min(prompts, len(s.SOURCES))))
    result = s.compare(engine, workload, ids, params, reps, concurrency)
    info = {
        "model": path.name,
        "speculation": "prompt lookup" if prompt_lookup else f"draft {Path(options['draft_model']).name}",
        "threads": config.num_threads,
        "temperature": temp,
        "load": "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    s.print_comparison(result, info)
    if json_out is not None:
        json_out.write_text(json.dumps({"system": info, **result.as_dict()}, indent=2) + "\n")
        print(f"results written to {json_out}", file=sys.stderr)
