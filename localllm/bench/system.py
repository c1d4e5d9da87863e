"""What a benchmark ran on: recorded with every result so numbers can be compared honestly."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def system_info(model_path: Path | None, backend: str, threads: int) -> dict[str, Any]:
    from localllm import __version__
    from localllm.config import physical_cores

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "backend": backend,
        "localllm_version": __version__,
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if backend == "numba":
        from localllm.kernels.matmul_int import KERNEL_FAMILY

        info["kernels"] = KERNEL_FAMILY  # which SIMD kernels ran: AVX-512 VNNI, AVX-512, AVX2, portable
    if model_path is not None:
        from localllm.download import sha256_file

        info["model_file"] = str(model_path)
        info["model_sha256"] = sha256_file(model_path)
    return info
