"""The newer architectures on random-weight files the fixtures never saw (other seeds and shapes, some
quantized by llama-quantize), against llama.cpp run there and then: how the steering side's held-out
check reads us. Needs arch_logits (tests/fixtures/make_arch_fixtures.py says how to build it).

    python scripts/heldout_conformance.py /tmp/arch_logits [--quantize LLAMA_QUANTIZE] [--only NAME ...]

A row per file: teacher-forced top-1 agreement (all positions; those where llama.cpp's margin is clear
of the near-tie bound), free-running greedy equal up to llama.cpp's first near-tie, the last position's
logit RMS against its bound, and the calibration (the NumPy oracle's figures on the same output).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fixtures")]

import tiny_arch  # noqa: E402
import tiny_gemma4  # noqa: E402
import tiny_gptoss  # noqa: E402
import tiny_hybrid  # noqa: E402

Writer = Callable[[Path], Path]


def cases() -> dict[str, tuple[Writer, str | None]]:
    """name -> (writer, llama-quantize type or None)."""
    a, h, g, o = tiny_arch, tiny_hybrid, tiny_gemma4, tiny_gptoss
    wide = a.Shape(dim=128, ffn=256, heads=8, kv_heads=2, head_dim=32)
    h_wide = h.Shape(dim=128, ffn=256, n_layers=8, heads=4, kv_heads=1, head_dim=64, rope_dim=16,
                     k_heads=4, v_heads=8, ssm_head_dim=32)  # fmt: skip
    o_wide = o.Shape(heads=4, kv_heads=1, head_dim=64, experts=16, used=2)
    h_even = h.Shape(dim=96, ffn=192, heads=2, kv_heads=2, head_dim=48, rope_dim=16, k_heads=3, v_heads=3,
                     ssm_head_dim=32, expert_ffn=48, shared_ffn=64)  # fmt: skip
    return {
        "smollm3 seed 21": (lambda p: a.write_variant(p, "smollm3", seed=21), None),
        "smollm3 8 heads": (lambda p: a.write_variant(p, "smollm3", seed=22, shape=wide, n_layers=8), None),
        "smollm3 Q4_K_M": (lambda p: a.write_variant(p, "smollm3", seed=23, shape=wide), "Q4_K_M"),
        "mistral3 seed 21": (lambda p: a.write_variant(p, "mistral3", seed=21), None),
        "mistral3 8 heads": (lambda p: a.write_variant(p, "mistral3", seed=22, shape=wide), None),
        "mistral3 Q4_K_M": (lambda p: a.write_variant(p, "mistral3", seed=23, shape=wide), "Q4_K_M"),
        "gemma4 seed 21": (lambda p: a.write_variant(p, "gemma4", seed=21), None),
        "gemma4_e seed 21": (lambda p: g.write_gemma4_variant(p, "gemma4_e", seed=21), None),
        "gemma4_moe seed 21": (lambda p: g.write_gemma4_variant(p, "gemma4_moe", seed=21), None),
        "gemma4_e Q8_0": (lambda p: g.write_gemma4_variant(p, "gemma4_e", quant="F32", seed=22), "Q8_0"),
        "gemma4_e Q8_0 31": (lambda p: g.write_gemma4_variant(p, "gemma4_e", quant="F32", seed=31), "Q8_0"),
        "gemma4_moe Q8_0": (lambda p: g.write_gemma4_variant(p, "gemma4_moe", quant="F32", seed=22), "Q8_0"),
        "gemma4 Q8_0": (lambda p: a.write_variant(p, "gemma4", quant="F32", seed=22), "Q8_0"),
        "smollm3 Q8_0": (lambda p: a.write_variant(p, "smollm3", seed=24, shape=wide), "Q8_0"),
        "mistral3 Q8_0": (lambda p: a.write_variant(p, "mistral3", seed=24, shape=wide), "Q8_0"),
        "smollm3 Q4_0": (lambda p: a.write_variant(p, "smollm3", seed=25, shape=wide), "Q4_0"),
        "gptoss seed 21": (lambda p: o.write_gptoss(p, seed=21), None),
        "gptoss 2 of 16 experts": (lambda p: o.write_gptoss(p, o_wide, seed=22), None),
        "qwen35 seed 21": (lambda p: h.write_hybrid(p, "qwen35", seed=21), None),
        "qwen35 8 value heads over 4": (lambda p: h.write_hybrid(p, "qwen35", seed=22, shape=h_wide), None),
        "qwen35 3 = 3 heads": (lambda p: h.write_hybrid(p, "qwen35", seed=23, shape=h_even), None),
        "qwen35 Q4_K_M": (lambda p: h.write_hybrid(p, "qwen35", "F32", seed=24, shape=h_wide), "Q4_K_M"),
        "qwen35moe seed 21": (lambda p: h.write_hybrid(p, "qwen35moe", seed=21), None),
        "qwen35moe wide": (lambda p: h.write_hybrid(p, "qwen35moe", seed=22, shape=h_wide), None),
        "qwen35 wide F32": (lambda p: h.write_hybrid(p, "qwen35", "F32", seed=22, shape=h_wide), None),
        "qwen35moe wide F32": (lambda p: h.write_hybrid(p, "qwen35moe", "F32", seed=22, shape=h_wide), None),
        "qwen3next wide F32": (lambda p: h.write_hybrid(p, "qwen3next", "F32", seed=22, shape=h_wide), None),
        "gptoss F32": (lambda p: o.write_gptoss(p, seed=21, quant="F32"), None),
        "qwen3next seed 21": (lambda p: h.write_hybrid(p, "qwen3next", seed=21), None),
        "qwen3next wide": (lambda p: h.write_hybrid(p, "qwen3next", seed=22, shape=h_wide), None),
    }


def check(tool: str, path: Path) -> str:
    from arch_conformance import (
        compare,
        engine,
        failures,
        greedy,
        greedy_problem,
        near_tie,
        rms_bound,
        teacher_forced,
    )
    from make_arch_fixtures import calibrate, llama_cpp, prompt_ids

    ref = llama_cpp(tool, path, prompt_ids())
    ref["calibration"] = calibrate(path, ref)
    e = engine(path)  # one load for both: the scoring pass, then the free-running greedy
    logits = teacher_forced(e, ref)
    fig = compare(logits, ref, near_tie(ref))["figures"]
    g = greedy_problem(greedy(e, ref), ref)
    bad = failures(logits, ref) + ([g] if g else [])
    cal = ref["calibration"]
    return (
        f"| {fig['agree_all']:.1%} | {fig['agree_clear']:.1%} | {'yes' if not g else 'NO'} | "
        f"{fig['rms_last']:.4f} / {rms_bound(ref):.4f} | {cal['agree_all']:.1%} | "
        f"{'ok' if not bad else '; '.join(bad[:2])} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch_logits")
    ap.add_argument("--quantize", help="llama-quantize, for the quantized rows (skipped without it)")
    ap.add_argument("--only", nargs="*", help="names starting with these")
    args = ap.parse_args()
    print("| file | top-1 all | top-1 clear | greedy | last RMS / bound | oracle top-1 | verdict |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, (write, qtype) in cases().items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            if qtype and not args.quantize:
                continue
            path = write(Path(d) / "model.gguf")
            if qtype:
                out = Path(d) / f"model-{qtype}.gguf"
                subprocess.run([args.quantize, str(path), str(out), qtype], check=True, capture_output=True)
                path = out
            print(f"| {name} {check(args.arch_logits, path)}", flush=True)


if __name__ == "__main__":
    main()
