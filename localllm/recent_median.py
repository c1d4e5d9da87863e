"""The lower median of a short window of timings: what the thread governor and the speculation policy
take as a step's time on a shared machine."""

from __future__ import annotations


def push_lower_median(samples: list[float], value: float, keep: int) -> float:
    """Append `value` to `samples` (in place), keep the last `keep`, and return their lower median: one
    step that another tenant's time slice delayed 2-3x does not move it, a sustained change does within
    keep // 2 + 1 steps."""
    samples.append(value)
    del samples[:-keep]
    return sorted(samples)[(len(samples) - 1) // 2]
