"""Benchmark output: a Rich table on a terminal (tab-separated lines when piped), or Markdown / JSON / CSV /
TSV for pasting and scripts."""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Any

COLUMNS = [
    "engine",
    "model",
    "size",
    "params",
    "quant",
    "backend",
    "threads",
    "KV",
    "test",
    "t/s",
    "GB/s",
    "RSS MB",
]


def _cells(row: Any) -> list[str]:
    return [
        row.engine,
        row.model,
        f"{row.size_bytes / 2**20:.1f} MiB" if row.size_bytes else "",
        f"{row.params / 1e6:.1f} M" if row.params else "",
        row.quant,
        row.backend,
        str(row.threads),
        row.kv,
        row.test,
        f"{row.mean:.2f} ± {row.sd:.2f}",
        f"{row.bandwidth_gbs:.1f}" if row.bandwidth_gbs else "",
        f"{row.peak_rss_mb:.0f}" if row.peak_rss_mb else "",
    ]


def print_offline(rows: list, ratios: list[tuple[str, int, float]], info: dict, output: str) -> None:
    if output == "table" and not sys.stdout.isatty():
        output = "tsv"  # piped: a Rich table would be folded to 80 columns
    if output == "json":
        print(
            json.dumps(
                {
                    "system": info,
                    "results": [r.as_dict() for r in rows],
                    "ratios": [{"test": t, "threads": n, "localllm_over_llama_cpp": x} for t, n, x in ratios],
                },
                indent=2,
            )
        )
    elif output in ("csv", "tsv"):
        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t" if output == "tsv" else ",", lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(_cells(r) for r in rows)
        print(buf.getvalue(), end="")
    elif output == "md":
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for r in rows:
            print("| " + " | ".join(_cells(r)) + " |")
        _print_ratios_md(ratios)
        print(f"\n{_system_line(info)}")
    else:
        _print_rich(rows, ratios, info)


def _print_ratios_md(ratios: list) -> None:
    if ratios:
        print("\n| test | threads | localllm / llama.cpp |\n|---|---|---|")
        for test, threads, x in ratios:
            print(f"| {test} | {threads} | {x:.2f}x |")


def _system_line(info: dict) -> str:
    kernels = f", {info['kernels']} kernels" if info.get("kernels") else ""
    return (
        f"{info['cpu']}, {info['physical_cores']} cores{kernels}; localllm {info['localllm_version']} "
        f"({info['git_revision']}), {info['date']}; model sha256 {info.get('model_sha256', '?')[:12]}"
    )


def _print_rich(rows: list, ratios: list, info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="localllm bench", caption=_system_line(info))
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in ("t/s", "GB/s", "RSS MB", "threads") else "left")
    for r in rows:
        table.add_row(*_cells(r))
    console = Console()
    console.print(table)
    for test, threads, x in ratios:
        console.print(f"{test} @ {threads} threads: localllm / llama.cpp = [bold]{x:.2f}x[/]")
