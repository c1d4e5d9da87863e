"""`--plot FILE.png` for the serving and batching benchmarks (needs the optional `plot` extra).

Each figure has two panels: throughput versus concurrency on the left, a latency CDF on the right, with
what it ran on in the title, so one image says what happened and where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError


def require_matplotlib() -> Any:
    """pyplot on a file-only backend, or one clear line on how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: we only write files
        import matplotlib.pyplot as plt
    except ImportError:
        raise LocalLLMError("--plot needs matplotlib: pip install 'localllm[plot]'") from None
    return plt


def _cdf(ax: Any, values: list[float], label: str, **style: Any) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=np.float64))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label, **style)


def _concurrency_axis(ax: Any, levels: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


def _throughput(ax: Any, conc: list[int], series: dict[str, list[float]], ylabel: str) -> None:
    """Lines from zero (so ratios read true); a lone line has its points labelled with their values."""
    for (label, values), marker in zip(series.items(), ("o-", "s--", "^:"), strict=False):
        ax.plot(conc, values, marker, label=label)
        for x, y in zip(conc, values, strict=True) if len(series) == 1 else ():
            ax.annotate(
                f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
            )
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title("Throughput")
    _concurrency_axis(ax, conc)
    ax.legend(loc="upper left")


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serving(levels: list[dict[str, Any]], info: dict[str, Any], path: Path) -> Path:
    """Output tokens/s per concurrency (vLLM's headline number); E2E (solid) and TTFT (dashed) CDFs."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    conc = [lv["concurrency"] for lv in levels]
    _throughput(left, conc, {"output tok/s": [lv["output_throughput"] for lv in levels]}, "output tokens / s")
    for i, lv in enumerate(levels):
        done = [r for r in lv["requests"] if r["ok"]]
        color = f"C{i}"
        _cdf(right, [r["e2e"] * 1000 for r in done], f"E2E @ {lv['concurrency']}", color=color)
        _cdf(right, [r["ttft"] * 1000 for r in done], f"TTFT @ {lv['concurrency']}", color=color, ls="--")
    right.set_xlabel("latency (ms)")
    right.set_ylabel("fraction of requests")
    right.set_title("Latency CDF")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    return _save(plt, fig, path, _title("bench serve", info))


def plot_batching(result: dict[str, Any], info: dict[str, Any], path: Path) -> Path:
    """Tokens/s per mode versus concurrency; request latency CDFs per mode at the highest concurrency."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = result["levels"]
    conc = [lv["concurrency"] for lv in levels]
    modes = ("continuous", "static", "contiguous")
    series = {m: [lv["runs"][m]["output_tokens_per_s"] for lv in levels] for m in modes}
    _throughput(left, conc, series, "output tokens / s")
    top = max(levels, key=lambda lv: lv["concurrency"])
    for mode, run in top["runs"].items():
        _cdf(right, run["latencies"], mode)
    right.set_xlabel("request latency (s, from workload start)")
    right.set_ylabel("fraction of requests")
    right.set_title(f"Latency CDF at concurrency {top['concurrency']}")
    right.grid(True, alpha=0.3)
    right.legend()
    return _save(plt, fig, path, _title("bench batching", info))


def _title(mode: str, info: dict[str, Any]) -> str:
    return (
        f"localllm {mode}: {info.get('target') or Path(str(info.get('model_file', '?'))).name}, "
        f"backend {info.get('backend', '?')}, {info.get('threads', '?')} threads, {info.get('cpu', '?')}"
    )
