"""The README's quality table: what each quantization type costs, localllm- and llama-quantize-made.

    python scripts/quality_table.py --llama-bin DIR [--source Q4_K_M.gguf] [--text FILE] [--chunks N]
    python scripts/quality_table.py --llama-bin DIR --on-load
    python scripts/quality_table.py --llama-bin DIR --compare-perplexity [--models a.gguf,b.gguf]

The first form makes an F16 GGUF by dequantizing the source (localllm quantize --type F16
--allow-requantize), quantizes it to each type with `localllm quantize` and with `llama-quantize`, saves
the F16 model's log-probabilities once (`localllm perplexity --save-logits`), then measures every file
with the same engine: perplexity and KL divergence against F16 in one pass (`--kl-divergence`), and
decode speed (`localllm bench -p 0 -n 64`).  It prints a Markdown table and a verdict per type (the
targets: localllm's perplexity within 1% of llama-quantize's, its mean KLD at most 1.1x).

The second form adds rows for quantize-on-load: the F16 model exported as a Hugging Face directory
(export_hf), then `prepare_model(..., "int8"/"int4")` as `LLM(HF_DIR, quantize=...)` does.

The third form runs `llama-perplexity` and `localllm perplexity` back to back on each model (ctx 512,
the same chunks of the same text) and prints both estimates, their gap and the speed ratio.

Everything is written under --work (default /tmp/localllm-quality); nothing is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path("~/.cache/localllm/models").expanduser()
TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")


def localllm(*args: str) -> str:
    cmd = [sys.executable, "-m", "localllm", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout + done.stderr


def bits_per_weight(path: Path) -> tuple[float, int]:
    """8 * tensor bytes / weights, over all tensors (as llama.cpp's BPW), and the weight count."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    n = sum(int(t.n_elements) for t in reader.tensors)
    return 8 * sum(int(t.n_bytes) for t in reader.tensors) / n, n


def make_files(args: argparse.Namespace, work: Path) -> dict[tuple[str, str], Path]:
    f16 = work / "f16.gguf"
    if not f16.exists():
        localllm("quantize", str(args.source), str(f16), "--type", "F16", "--allow-requantize")
    files = {("F16", "-"): f16}
    for t in TYPES:
        ours, theirs = work / f"localllm-{t}.gguf", work / f"llama-{t}.gguf"
        if not ours.exists():
            localllm("quantize", str(f16), str(ours), "--type", t)
        if not theirs.exists():
            run([str(args.llama_bin / "llama-quantize"), str(f16), str(theirs), t, str(args.threads)])
        files[(t, "localllm")] = ours
        files[(t, "llama-quantize")] = theirs
    return files


def measure(path: Path, base: Path, threads: int) -> dict:
    start = time.perf_counter()
    kld = json.loads(
        localllm("perplexity", str(path), "-", "--kl-divergence", str(base), "--json", "-t", str(threads))
    )
    kld["wall_s"] = time.perf_counter() - start
    bench = json.loads(
        localllm("bench", "-m", str(path), "-p", "0", "-n", "64", "-r", "2", "-t", str(threads), "-o", "json")
    )
    result = bench["results"][0]
    kld["tg_mean"], kld["tg_sd"] = result["tokens_per_s"], result["sd"]
    return kld


def quality_table(args: argparse.Namespace) -> None:
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    files = make_files(args, work)
    base = work / "f16.logits"
    if not base.exists():
        f16 = str(files["F16", "-"])
        localllm("perplexity", f16, str(args.text), "-c", "512", "--chunks", str(args.chunks),
                 "--save-logits", str(base), "--json", "-t", str(args.threads))  # fmt: skip
    rows = {}
    for key, path in files.items():
        rows[key] = {**measure(path, base, args.threads), "bytes": path.stat().st_size}
        rows[key]["bpw"] = bits_per_weight(path)[0]
        print(f"# {key}: {json.dumps(rows[key])}", file=sys.stderr, flush=True)
    (work / "quality.json").write_text(json.dumps({f"{t}|{m}": r for (t, m), r in rows.items()}, indent=1))
    print_table(rows)


def on_load_table(args: argparse.Namespace) -> None:
    """Rows for `LLM(HF_DIR, quantize=...)`: the F16 model exported as a Hugging Face directory, then
    quantized on load (int8, int4), measured against the same F16 logits."""
    from localllm.convert.export_hf import export_hf
    from localllm.convert.on_load import prepare_model

    work = args.work
    hf = work / "f16-hf"
    if not hf.exists():
        export_hf(work / "f16.gguf", hf, dtype="float16")
    rows = {}
    for q in ("int8", "int4"):
        path = prepare_model(str(hf), work / "home", q)
        key = (f"{q} on load ({path.stem.rsplit('-', 1)[-1]})", "localllm")
        rows[key] = {**measure(path, work / "f16.logits", args.threads), "bytes": path.stat().st_size}
        rows[key]["bpw"] = bits_per_weight(path)[0]
        print(f"# {key}: {json.dumps(rows[key])}", file=sys.stderr, flush=True)
    print_table(rows, verdicts=False)


def print_table(rows: dict, verdicts: bool = True) -> None:
    print("| type | made by | MiB | bits/weight | PPL | KLD vs F16 (mean, p99) | same top-1 | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (t, maker), r in rows.items():
        print(
            f"| {t} | {maker} | {r['bytes'] / 2**20:.1f} | {r['bpw']:.2f} "
            f"| {r['ppl']:.4f} ± {r['ppl_stderr']:.4f} | {r['kld_mean']:.5f} ± {r['kld_stderr']:.5f}, "
            f"{r['kld_p99']:.4f} | {100 * r['same_top_p']:.2f}% "
            f"| {r['tg_mean']:.1f} ± {r['tg_sd']:.1f} |"
        )
    print()
    for t in TYPES if verdicts else ():
        ours, theirs = rows[t, "localllm"], rows[t, "llama-quantize"]
        ppl_gap = ours["ppl"] / theirs["ppl"] - 1
        kld_ratio = ours["kld_mean"] / theirs["kld_mean"] if theirs["kld_mean"] else float("nan")
        ok = abs(ppl_gap) <= 0.01 and kld_ratio <= 1.1
        verdict = "ok" if ok else "MISSED"
        print(f"{t}: PPL {100 * ppl_gap:+.3f}% vs llama-quantize's, KLD x{kld_ratio:.3f}: {verdict}")


def compare_perplexity(args: argparse.Namespace) -> None:
    print("| model | llama-perplexity | localllm | gap | llama.cpp tok/s | localllm tok/s | speed ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    n_tokens = 512 * args.chunks
    for model in args.models.split(","):
        path = Path(model) if "/" in model else MODELS / model
        start = time.perf_counter()
        out = run([str(args.llama_bin / "llama-perplexity"), "-m", str(path), "-f", str(args.text),
                   "-c", "512", "--chunks", str(args.chunks), "-t", str(args.threads)])  # fmt: skip
        theirs_s = time.perf_counter() - start
        theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))
        theirs_rate = n_tokens / (_stamp(out, "Final estimate") - _stamp(out, "calculating perplexity"))
        start = time.perf_counter()
        ours = json.loads(localllm("perplexity", str(path), str(args.text), "-c", "512", "--chunks",
                                   str(args.chunks), "--json", "-t", str(args.threads)))  # fmt: skip
        ours_s = time.perf_counter() - start
        ours_rate = n_tokens / ours["seconds"]  # both: the scoring only, from its start to the final line
        print(
            f"| {path.name} | {theirs:.4f} | {ours['ppl']:.4f} ± {ours['ppl_stderr']:.4f} "
            f"| {100 * (ours['ppl'] / theirs - 1):+.3f}% | {theirs_rate:.1f} | {ours_rate:.1f} "
            f"| {ours_rate / theirs_rate:.2f}x (whole runs {theirs_s:.0f} s vs {ours_s:.0f} s) |",
            flush=True,
        )


def _stamp(log: str, what: str) -> float:
    """Seconds at a llama.cpp log line (its prefix is minutes.seconds.ms.us)."""
    m, sec, ms, us = re.search(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I [^\n]*" + what, log).groups()
    return 60 * int(m) + int(sec) + int(ms) / 1e3 + int(us) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin directory")
    p.add_argument("--source", type=Path, default=MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    p.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", type=Path, default=Path("/tmp/localllm-quality"))
    p.add_argument("--compare-perplexity", action="store_true")
    p.add_argument(
        "--on-load", action="store_true", help="rows for --quantize int8/int4 on load (after the table)"
    )
    p.add_argument(
        "--models",
        default="SmolLM2-135M-Instruct.Q4_1.gguf,qwen2.5-coder-0.5b-instruct-q4_k_m.gguf,gemma-3-270m-q4_k_m.gguf",
    )
    args = p.parse_args()
    if args.compare_perplexity:
        compare_perplexity(args)
    elif args.on_load:
        on_load_table(args)
    else:
        quality_table(args)


if __name__ == "__main__":
    main()
