"""How many threads a step should use, learned from the steps themselves.

A parallel kernel launch ends at a barrier: if another process holds one of the two cores, every
launch waits for the descheduled worker's next time slice, and a 2-thread decode step (hundreds of
launches) collapses from ~10 ms to ~200 ms, worse than one thread (~12 ms). So the backend times its
steps with every candidate thread count and runs each step size with the fastest; it re-measures the
others now and then (exponentially less often while the choice holds), so it follows the machine as
other work comes and goes. On a quiet machine this settles on all threads after a few steps.

A step size never seen before starts from the nearest measured size's choice and probe schedule instead
of timing every candidate afresh: speculative decoding's verify steps bring up to eight new sizes, and on a
loaded machine each first 2-thread step can cost ten 1-thread ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from localllm.recent_median import push_lower_median

# A thread count's running step time is the median of its last RECENT steps: one step that another
# tenant's time slice delayed 3x cannot flip the choice (a running average did, where the two counts are
# close: docs/benchmarks.md, Design measurements), while a sustained slowdown does in 3 steps.
RECENT = 5
FIRST_PROBE, MAX_PROBE = 8, 256  # steps between re-measurements: start, and cap while the choice holds
INHERIT_UP_TO = 16  # step sizes (exact buckets) that start from a measured neighbour's choice
# A settled choice yields only to a candidate this much faster: one step delayed by another tenant's
# time slice (3x its usual time) would otherwise flip a quiet machine to 1 thread until the next probe.
SWITCH_MARGIN = 0.9


@dataclass(slots=True)
class _Bucket:
    """Running step times of one step size, per thread count."""

    times: dict[int, float] = field(default_factory=dict)
    recent: dict[int, list[float]] = field(default_factory=dict)
    best: int = 0
    since_probe: int = 0
    probe_every: int = FIRST_PROBE


class ThreadGovernor:
    def __init__(self, max_threads: int, adaptive: bool = True):
        self.max_threads = max(1, max_threads)
        self.candidates = sorted({self.max_threads, 1}, reverse=True) if adaptive else [self.max_threads]
        self._buckets: dict[int, _Bucket] = {}
        self.last = self.max_threads  # the thread count choose() gave the latest step

    @staticmethod
    def bucket_of(n_tokens: int) -> int:
        """Steps of similar size share their measurements: exact up to 16 tokens, then powers of 2."""
        return n_tokens if n_tokens <= 16 else 16 + int(math.log2(n_tokens))

    def choose(self, n_tokens: int) -> int:
        """The thread count for a step of n_tokens: an unmeasured candidate first, else the fastest,
        except on a probe step, which re-measures the runner-up."""
        self.last = self._choose(n_tokens)
        return self.last

    def _choose(self, n_tokens: int) -> int:
        if len(self.candidates) == 1:
            return self.candidates[0]
        b = self._bucket(n_tokens)
        unmeasured = [n for n in self.candidates if n not in b.times]
        if unmeasured and not b.best:  # a fresh bucket times each candidate; an inherited one probes
            return unmeasured[0]
        if b.since_probe >= b.probe_every:
            return next(n for n in self.candidates if n != b.best)
        return b.best

    def record(self, n_tokens: int, threads: int, seconds: float) -> None:
        if len(self.candidates) == 1:
            return
        b = self._bucket(n_tokens)
        probed = b.best != 0 and threads != b.best
        recent = b.recent.setdefault(threads, [])
        if probed:  # the running choice is smoothed; a probe's old figures are stale, the probe replaces them
            recent.clear()
        b.times[threads] = push_lower_median(recent, seconds, RECENT)
        best = _faster(b.times, b.best)
        if probed:  # a probe: back off while the choice holds, look again soon when it flips
            b.probe_every = min(MAX_PROBE, 2 * b.probe_every) if best == b.best else FIRST_PROBE
            b.since_probe = 0
        else:
            b.since_probe += 1
        b.best = best if len(b.times) == len(self.candidates) else b.best

    def _bucket(self, n_tokens: int) -> _Bucket:
        """n_tokens' bucket; a new small one (decode and verify steps) inherits the nearest settled small
        bucket's choice and probe interval: it runs that choice, and times the other at its first probe."""
        key = self.bucket_of(n_tokens)
        b = self._buckets.get(key)
        if b is None:
            settled = [k for k, o in self._buckets.items() if o.best and k <= INHERIT_UP_TO]
            b = self._buckets[key] = _Bucket()
            if settled and key <= INHERIT_UP_TO:
                near = self._buckets[min(settled, key=lambda k: (abs(k - key), k))]
                b.best, b.probe_every = near.best, near.probe_every
        return b

    def current_choice(self, n_tokens: int) -> int | None:
        """The settled choice for a step size (None before it was measured with every candidate)."""
        b = self._buckets.get(self.bucket_of(n_tokens))
        return b.best or None if b else None

    def ran_probe(self, n_tokens: int) -> bool:
        """Whether the latest step, of n_tokens, ran with a thread count the governor was only
        re-measuring (its choice for that size, after recording the step, is another)."""
        choice = self.current_choice(n_tokens)
        return choice is not None and choice != self.last


class ModelGovernors:
    """A backend's governors, one per model it runs (Backend.thread_governor): a draft model's steps
    would mislead its target's choice."""

    def __init__(self, max_threads: int, adaptive: bool = True):
        self._choices = (max_threads, adaptive)
        self._by_model: dict[int, tuple[object, ThreadGovernor]] = {}  # id(model) -> (model, governor)

    def of(self, model: object) -> ThreadGovernor:
        entry = self._by_model.get(id(model))
        if entry is None:  # the model kept alive with it: its id is not reused meanwhile
            entry = self._by_model[id(model)] = (model, ThreadGovernor(*self._choices))
        return entry[1]


def _faster(times: dict[int, float], current: int) -> int:
    """The fastest thread count, keeping `current` unless another beats it by SWITCH_MARGIN."""
    best = min(times, key=times.__getitem__)
    if current in times and best != current and times[best] > SWITCH_MARGIN * times[current]:
        return current
    return best
