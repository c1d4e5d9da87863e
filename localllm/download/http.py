"""Resumable HTTP(S) downloads: a Range request continues a .part file, a stalled or cut transfer is
retried, and the server's answer is checked against what was asked."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from localllm.errors import DownloadError

# The HTTP, zip and Rich stacks (slow imports) load only in the functions that transfer or display.
if TYPE_CHECKING:
    import http.client

    from rich.progress import Progress, TaskID
from localllm.download.writes import CHUNK, _Reader, _write

TIMEOUT_S = 30.0  # per socket operation; a stalled server becomes a resumable interruption


class _Interrupted(Exception):
    """A transfer that stopped early; the .part file keeps what arrived, so the next try resumes."""


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
