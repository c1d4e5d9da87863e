"""Grammar masks for a step computed on a helper thread while the forward pass runs.

A constrained sequence's next-token mask depends only on the tokens it has already accepted, so it can
be computed before the logits exist, and llguidance releases the GIL while it computes. On 2 cores it
did not pay (a mask is a tiny part of a step, and the thread competes with the forward pass's own:
docs/benchmarks.md, Design measurements). So masks are computed in line unless
`LOCALLLM_MASK_OVERLAP=1` (machines with cores to spare; both give the same tokens).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class _Done:
    def wait(self) -> None:
        return None


class _Pending:
    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> None:
        self.future.result()  # re-raises a failure of the mask computation here, on the engine thread


class MaskPrefetcher:
    def __init__(self, overlap: bool | None = None):
        if overlap is None:
            overlap = os.environ.get("LOCALLLM_MASK_OVERLAP", "0") == "1"
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None

    def start(self, scheduled: list[Any]) -> _Done | _Pending:
        """Begin computing the masks of the constrained sequences that sample in this step."""
        constraints = [item.seq.constraint for item in scheduled if item.samples and item.seq.constraint]
        if not constraints or not self.overlap:
            return _Done()  # without overlap, ModelRunner._sample computes each mask when it needs it
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="localllm-mask")
        return _Pending(self._pool.submit(_fill, constraints))

    def close(self) -> None:
        """Stop the mask thread, if one started (the engine is being closed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _fill(constraints: list[Any]) -> None:
    for constraint in constraints:
        constraint.fill_mask()
