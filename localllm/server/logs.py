"""Log hygiene for `localllm serve`: a flood of bad clients must not flood the log.

`RateLimitFilter` sits on the log handler. Warnings and errors (and info records that ask for it with
`extra={"rate_key": ...}`, as refused requests do) pass once per kind per interval; the next one
that passes says how many were dropped. A kind is the logger, the message template and the exception
type. Network noise (resets, broken pipes, cancelled tasks, running out of descriptors) never carries
a traceback: its one-line message says everything.
"""

from __future__ import annotations

import asyncio
import logging
import time

INTERVAL_S = 10.0
QUIET_ERRORS = (OSError, asyncio.CancelledError, asyncio.TimeoutError)


class RateLimitFilter(logging.Filter):
    def __init__(self, interval: float = INTERVAL_S):
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str, str], float] = {}
        self._dropped: dict[tuple[str, str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        rate_key = getattr(record, "rate_key", None)
        if record.levelno < logging.WARNING and rate_key is None:
            return True  # ordinary info: one line per finished request, banners
        error = record.exc_info[1] if record.exc_info else None
        key = (record.name, str(record.msg) + str(rate_key or ""), type(error).__name__)
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {self.interval:.0f} s)"
        if isinstance(error, QUIET_ERRORS):
            detail = f"{type(error).__name__}: {error}"
            detail = detail.replace("%", "%%") if record.args else detail  # msg % args comes later
            record.msg = f"{record.msg}: {detail}"
            record.exc_info, record.exc_text = None, None
        return True
