"""A competing load for `localllm bench --busy N`: N processes that each keep one core busy.

On a laptop something else is always running; decode that only holds up on an idle machine is not
what users get. The busy loops are bounded (they stop by themselves after `max_seconds`, should the
benchmark die without stopping them) and are stopped when the block ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_load(n: int, max_seconds: float = 3600.0) -> Iterator[list[subprocess.Popen]]:
    """Within this block, n extra processes spin on the CPU (none for n <= 0)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _LOOP.format(seconds=max_seconds)]) for _ in range(max(0, n))
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def label(test: str, n: int) -> str:
    """The test name a row gets when it ran under load: tg128 -> 'tg128 busy1'."""
    return f"{test} busy{n}" if n > 0 else test
