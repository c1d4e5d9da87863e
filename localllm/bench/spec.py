"""`localllm bench spec`: decode speed with speculative decoding on and off, interleaved on ONE engine
(the same weights, KV pool, threads and machine load), on built-in workloads:

- edit: "rewrite this code with one change" over snippets of localllm's own source (answers copy the
  prompt: prompt lookup's case);
- code: raw code completion from the start of localllm's own modules (a draft model's case);
- creative: free-form stories at temperature 1 (drafts mostly rejected: speculation must not cost).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("edit", "code", "creative")
WARMUP_ROUNDS = 2
SOURCES = (
    "engine/block_manager.py",
    "engine/scheduler.py",
    "sampler.py",
    "engine/sequence.py",
    "engine/output.py",
    "engine/kv_cache.py",
    "engine/loop_guard.py",
    "engine/detokenizer.py",
)
STORIES = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a poem about autumn rain in a busy city.",
    "Describe the weather and wildlife of an imaginary planet.",
    "Tell a fable about a fox and a clockmaker.",
)


@dataclass
class SpecComparison:
    workload: str
    concurrency: int
    off: list[float] = field(default_factory=list)  # tokens/s per repetition
    on: list[float] = field(default_factory=list)
    drafted: int = 0  # over the timed runs with speculation on
    accepted: int = 0

    @property
    def speedup(self) -> float:
        return statistics.fmean(self.on) / statistics.fmean(self.off) if self.off and self.on else 0.0

    @property
    def paired_speedup(self) -> float:
        """The median over rounds of on / off within the round: the two ran back to back, so a load
        change between rounds (which swings the means on a shared machine) mostly cancels."""
        ratios = [a / b for a, b in zip(self.on, self.off, strict=True) if b]
        return statistics.median(ratios) if ratios else 0.0

    def as_dict(self) -> dict[str, Any]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {
            "workload": self.workload,
            "concurrency": self.concurrency,
            "off_tokens_per_s": _stats(self.off),
            "on_tokens_per_s": _stats(self.on),
            "speedup": self.speedup,
            "paired_speedup": self.paired_speedup,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": rate,
        }


def _stats(samples: list[float]) -> dict[str, float]:
    sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return {"mean": statistics.fmean(samples) if samples else 0.0, "sd": sd, "samples": samples}


def _snippets(count: int, lines: int) -> list[tuple[str, str]]:
    """(module name, its first `lines` lines) from localllm's own sources."""
    root = Path(__file__).resolve().parent.parent
    out = []
    for rel in SOURCES[:count]:
        text = (root / rel).read_text(encoding="utf-8")
        out.append((rel, "\n".join(text.splitlines()[:lines]) + "\n"))
    return out


def workload_prompts(engine: Any, workload: str, count: int) -> list[list[int]]:
    """The workload's prompts as token ids (chat-templated where the model has a template, but code)."""
    if workload == "code":
        return [engine.tokenize_prompt(text) for _, text in _snippets(count, 40)]
    if workload == "edit":
        asks = [
            f"Here is {name}:\n```python\n{text}```\nRename every `seq` to `sequence` and output the "
            "complete file, otherwise unchanged."
            for name, text in _snippets(count, 60)
        ]
    else:
        asks = [STORIES[i % len(STORIES)] for i in range(count)]
    return [_chat(engine, ask) for ask in asks]


def _chat(engine: Any, ask: str) -> list[int]:
    from localllm.tokenizer.chat_template import apply_chat_template, resolve_chat_template

    template = resolve_chat_template(engine.gguf.metadata)
    if template is None:
        return engine.tokenize_prompt(ask)
    return apply_chat_template(engine.tokenizer, template, [{"role": "user", "content": ask}])


def decode_rate(engine: Any, prompts: list[list[int]], params: Any, concurrency: int) -> float:
    """Alone (concurrency 1): decode tokens/s after each first token, llama.cpp's eval rate. Batched:
    generated tokens over the wall time, `concurrency` requests at a time."""
    if concurrency == 1:
        outs = [engine.generate([p], params)[0] for p in prompts]
        tokens = sum(max(o.generated_tokens - 1, 0) for o in outs)
        return tokens / max(sum(o.elapsed - (o.ttft or 0.0) for o in outs), 1e-9)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), concurrency):
        tokens += sum(o.generated_tokens for o in engine.generate(prompts[i : i + concurrency], params))
    return tokens / (time.perf_counter() - start)


def compare(
    engine: Any, workload: str, prompts: list[list[int]], params: Any, reps: int, concurrency: int
) -> SpecComparison:
    """Speculation off and on, alternating which goes first, after two untimed runs of each (the thread
    governor learns each new step size, and verify steps bring eight new ones)."""
    spec = engine.spec
    result = SpecComparison(workload, concurrency)
    for rep in range(-WARMUP_ROUNDS, reps):
        for on in (False, True) if rep % 2 else (True, False):
            spec.enabled = on
            drafted, accepted = spec.stats.drafted_tokens, spec.stats.accepted_tokens
            rate = decode_rate(engine, prompts, params, concurrency)
            if rep < 0:
                continue  # warm-up: kernels, and the policy's first step costs
            (result.on if on else result.off).append(rate)
            result.drafted += spec.stats.drafted_tokens - drafted
            result.accepted += spec.stats.accepted_tokens - accepted
    spec.enabled = True
    return result


def print_comparison(result: SpecComparison, info: dict[str, Any]) -> None:
    d = result.as_dict()
    off, on = d["off_tokens_per_s"], d["on_tokens_per_s"]
    what = "decode tok/s" if result.concurrency == 1 else f"tok/s at concurrency {result.concurrency}"
    print(f"| workload | {what}, off | on | speedup | paired | drafted | accepted | acceptance |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {result.workload} | {off['mean']:.2f} ± {off['sd']:.2f} | {on['mean']:.2f} ± {on['sd']:.2f} | "
        f"{result.speedup:.2f}x | {result.paired_speedup:.2f}x | {result.drafted} | {result.accepted} | "
        f"{100 * d['acceptance_rate']:.0f}% |"
    )
    print("paired: the median of on / off within each round (back to back); rounds: " + _rounds(result))
    print(
        f"\n{info.get('model')} ({info.get('speculation')}), {info.get('threads')} threads, " + info["load"]
    )


def _rounds(result: SpecComparison) -> str:
    return ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(result.on, result.off, strict=True))
