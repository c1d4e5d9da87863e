"""Greedy agreement with llama.cpp for the f16 and the q8_0 KV cache, each against llama.cpp's same setting.

    python scripts/kv_q8_agreement.py MODEL.gguf [MODEL.gguf ...] --gen 48

For each model, prompt and cache type (f16, q8_0 for both K and V) llama.cpp's greedy continuation
(tests/fixtures/kv_greedy.cpp against the built libllama, flash attention on as a quantized V needs) is
compared with localllm's (numba, 2 threads) as ../shared/reference/README.md says: teacher-forced top-1
agreement over llama.cpp's tokens (all, and where its margin >= 0.5), and the free-running match length
with whether it holds up to llama.cpp's first margin < 0.5. Prints one JSON line per case and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import numpy as np

LLAMA = Path(os.environ.get("LLAMA_DIR", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"))
SOURCE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "kv_greedy.cpp"
PROMPTS = {
    "france": "The capital of France is",
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "long": None,  # ~700 tokens of this repository's source: the cache's rounding adds up over context
}


def build(binary: Path) -> Path:
    if not binary.exists():
        inc = f"-I{LLAMA}/include -I{LLAMA}/ggml/include"
        libs = f"-L{LLAMA}/build/bin -lllama -lggml -lggml-base -Wl,-rpath,{LLAMA}/build/bin"
        subprocess.run(f"g++ -O2 -std=c++17 {inc} {SOURCE} -o {binary} {libs}", shell=True, check=True)
    return binary


def llama_greedy(binary: Path, model: str, ids: list[int], gen: int, cache: str) -> dict:
    out = subprocess.run([str(binary), model, ",".join(map(str, ids)), str(gen), cache], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout)


def compare(engine, ids: list[int], ref: dict) -> dict:
    from localllm.engine.engine import score_tokens
    from localllm.sampling_params import SamplingParams

    want, margin = ref["greedy"], np.array(ref["margin"])
    logits = np.asarray(score_tokens(engine, ids + want[:-1]))[len(ids) - 1 :]
    top1 = logits.argmax(-1) == np.array(want)
    sure = margin >= 0.5
    params = SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True)
    got = engine.generate([ids], params)[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want))
    first_tie = int(np.argmax(~sure)) if (~sure).any() else len(want)
    return {
        "teacher_forced": round(float(top1.mean()), 4),
        "teacher_forced_sure": round(float(top1[sure].mean()), 4) if sure.any() else 1.0,
        "greedy_match": same, "first_margin_below_0.5": first_tie, "greedy_ok": same >= first_tie,
    }  # fmt: skip


def run_model(binary: Path, model: str, gen: int, prompts: list[str]) -> list[dict]:
    from localllm.llm import default_numba_cache

    home = Path("~/.cache/localllm").expanduser()
    default_numba_cache(home)  # before any kernel import: keyed by all their sources, as in the CLI
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    rows = []
    for cache in ("f16", "q8_0"):
        kv = {"cache_type_k": cache, "cache_type_v": cache}
        config = EngineConfig(
            model=model, threads=2, index_dir=home / "index", ctx_size=2048, max_num_seqs=1, **kv
        )
        engine = LLMEngine(config)
        text = "".join(p.read_text() for p in sorted(Path("localllm/engine").glob("*.py")))
        for name in prompts:
            prompt = PROMPTS[name]
            ids = engine.tokenize_prompt(prompt if prompt is not None else text)[:700]
            row = {"model": Path(model).name, "cache": cache, "prompt": name, "prompt_tokens": len(ids)}
            row |= compare(engine, ids, llama_greedy(binary, model, ids, gen, cache))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+")
    parser.add_argument("--gen", type=int, default=48)
    parser.add_argument("--binary", type=Path, default=Path("/tmp/kv_greedy"))
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="which of them, comma-separated")
    a = parser.parse_args()
    binary = build(a.binary)
    rows = [r for m in a.models for r in run_model(binary, m, a.gen, a.prompts.split(","))]
    for model in dict.fromkeys(r["model"] for r in rows):
        for cache in ("f16", "q8_0"):
            mine = [r for r in rows if r["model"] == model and r["cache"] == cache]
            tf = np.mean([r["teacher_forced"] for r in mine])
            sure = np.mean([r["teacher_forced_sure"] for r in mine])
            ok = sum(r["greedy_ok"] for r in mine)
            match = sum(r["greedy_match"] for r in mine)
            print(f"{model} {cache}: teacher-forced {tf:.3f} (margin>=0.5: {sure:.3f}), "
                  f"greedy ok {ok}/{len(mine)}, matched tokens {match}/{len(mine) * a.gen}")  # fmt: skip


if __name__ == "__main__":
    main()
