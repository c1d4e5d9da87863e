"""Writing fetched bytes: the copy loop, a write error as one line naming the file and what to do, and
the progress bar on stderr."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from localllm.errors import DownloadError

# The HTTP, zip and Rich stacks (slow imports) load only in the functions that transfer or display.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID


CHUNK = 1 << 20


_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)  # disk quota exceeded (not every platform names it)


# What to do about an error writing the cache, by errno.
_WRITE_HINTS = {
    errno.ENOSPC: "free some space, or set LOCALLLM_HOME to a folder on a larger disk",
    _EDQUOT: "free some space, or set LOCALLLM_HOME to a folder on a larger disk",
    errno.EACCES: "check the folder's permissions, or set LOCALLLM_HOME to a folder you can write",
    errno.EPERM: "check the folder's permissions, or set LOCALLLM_HOME to a folder you can write",
    errno.EROFS: "set LOCALLLM_HOME to a folder on a writable disk",
}


class _Reader(Protocol):
    def read(self, n: int = ..., /) -> bytes: ...


def _write_error(e: OSError, path: Path, during: str = "") -> DownloadError:
    """One line: the file, the cause and what to do about it."""
    where = e.filename or path
    hint = _WRITE_HINTS.get(e.errno or 0)
    return DownloadError(f"cannot write {where}{during}: {e.strerror or e}{f' ({hint})' if hint else ''}.")


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
