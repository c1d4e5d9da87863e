"""Where a `localllm run`'s resident memory goes: RSS after localllm is imported, after the engine has
loaded (Numba and the kernels, the weights, the pools), and the peak of the whole run, each with its
largest mappings. The run is the CLI's own (`localllm run FILE PROMPT ...`), in this process.

    python scripts/memory_stages.py FILE -c 260 -t 2 -n 4 --words 47 [--json OUT]

Compare the peak with llama.cpp's at the same context (`/usr/bin/time -v llama-bench -m FILE -p 256
-n 4 -t 2 -r 1`); docs/benchmarks.md (Memory) has the figures. Linux only (/proc/self).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

_MAP = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def status_mib() -> dict[str, float]:
    """VmRSS, VmHWM (the peak so far), RssAnon and RssFile of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def largest_mappings(top: int = 6) -> list[tuple[str, float]]:
    """The mappings holding most resident memory (by file name, or [anon] / [heap]), MiB."""
    per: collections.Counter[str] = collections.Counter()
    name = "[anon]"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if _MAP.match(line):
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) > 5 else "[anon]"
            name = Path(path).name if path.startswith("/") else path
        elif line.startswith("Rss:"):
            per[name] += int(line.split()[1])
    return [(k, v / 1024) for k, v in per.most_common(top)]


def stage(name: str, rows: list[dict]) -> None:
    rows.append({"stage": name, **status_mib(), "largest": largest_mappings()})


def run_cli(args: list[str], rows: list[dict]) -> None:
    """`localllm run ARGS` with a stage recorded once the engine is built."""
    import localllm.engine.engine as engine_module
    from localllm.cli import main

    init = engine_module.LLMEngine.__init__

    def recorded(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        stage("engine loaded", rows)

    engine_module.LLMEngine.__init__ = recorded  # type: ignore[method-assign]
    sys.argv = ["localllm", "run", *args]
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        engine_module.LLMEngine.__init__ = init  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-c", default="260")
    ap.add_argument("-t", default="2")
    ap.add_argument("-n", default="4")
    ap.add_argument("--words", type=int, default=47, help="the prompt: 'hello ' this many times")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows: list[dict] = []
    stage("start", rows)
    import localllm.engine.engine  # noqa: F401  (as the CLI: it sets Numba's cache up before Numba starts)

    stage("localllm imported", rows)
    run_cli([a.model, "hello " * a.words, "-c", a.c, "-t", a.t, "-n", a.n], rows)
    stage("after the run", rows)
    print("\n| stage | RSS MiB | peak so far | anonymous | file-backed | largest mappings (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        big = ", ".join(f"{k} {v:.0f}" for k, v in r["largest"][:4])
        cells = [f"{r[k]:.1f}" for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")]
        print(f"| {r['stage']} | " + " | ".join(cells) + f" | {big} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
