"""Output files written under a temporary name and renamed into place at the end (`localllm quantize`,
`convert`, quantize on load, --save-logits), so nothing ever sees half a file under the final name.

The temporary file is `.NAME.PID.part` beside NAME. Whatever stops the writer, it is removed:
an exception or Ctrl-C (SIGINT) unwinds through `partial_output`'s `finally`; SIGTERM and SIGHUP,
which would end the process without unwinding, are turned into the same unwinding (SystemExit with
status 128 + the signal) while a file is written. SIGKILL (or a power cut) cannot be caught: that file
stays, and the next write of the same NAME removes it and says so on stderr. A writer holds a lock on
its file (flock), so only files no live writer holds are removed; where there are no such locks
(Windows) the PID in the name decides.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

UNWOUND_SIGNALS = ("SIGTERM", "SIGHUP")


def part_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{os.getpid()}.part")


@contextlib.contextmanager
def partial_output(dest: str | os.PathLike) -> Iterator[Path]:
    """The temporary path to write `dest` into; the caller renames it (os.replace) when complete.
    Removed on every way out, the rename aside; stale ones of `dest` are removed first."""
    dest = Path(dest)
    remove_stale(dest)
    tmp = part_path(dest)
    lock = open_locked(tmp)
    if fcntl is None:
        lock.close()  # Windows renames no file that is open elsewhere; the PID in the name decides
    try:
        with unwinding_signals():
            yield tmp
    finally:
        tmp.unlink(missing_ok=True)
        lock.close()


def open_locked(path: Path, mode: str = "wb") -> IO[bytes]:
    """`path` opened (created) and locked for as long as the returned file stays open."""
    f = open(path, mode)  # noqa: SIM115 (the caller closes it)
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without locks: the PID decides alone
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


@contextlib.contextmanager
def unwinding_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while inside (main thread, default handlers only: a
    handler someone else installed, or an ignored SIGHUP under nohup, is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    for name in UNWOUND_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is signal.SIG_DFL:
            previous[number] = signal.signal(number, _unwind)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _unwind(number: int, frame: Any) -> None:
    raise SystemExit(128 + number)


def remove_stale(dest: Path) -> list[Path]:
    """Delete the `.NAME.PID.part` files of `dest` that no live writer holds; report them on stderr."""
    removed = []
    for path in dest.parent.glob(f".{glob.escape(dest.name)}.*.part"):
        pid = path.name[len(dest.name) + 2 : -len(".part")]
        if not pid.isdigit() or int(pid) == os.getpid() or not _abandoned(path, int(pid)):
            continue
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            path.unlink()
            removed.append(path)
            print(
                f"removed {path.name} ({size / 2**20:.1f} MiB), left by a localllm run that was killed",
                file=sys.stderr,
            )
    return removed


def _abandoned(path: Path, pid: int) -> bool:
    import psutil

    if not psutil.pid_exists(pid):
        return True
    if fcntl is None:
        return False
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when f closes
            return True
    except OSError:  # held by its writer (BlockingIOError), or gone
        return False
