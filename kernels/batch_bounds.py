"""A fused step's batch arrays checked in one compiled pass: backends/bounds.check_step's element checks
(slots, query starts, context lengths, block tables), which in NumPy took ~10 reductions and ~25 us of
Python a decode step. The NumPy checks in backends/bounds.py are its twin: they run where this says no,
and name the failure."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def batch_arrays_ok(slots, positions, qsl, ctx, tables, t, n_slots, block_size, n_blocks) -> bool:
    """Whether one slot and position per token (t of them) with slots in [-1, n_slots), query starts
    from 0 to t without a step back, context lengths at least each sequence's tokens and within its
    block table's blocks of block_size, and block ids in [0, n_blocks) (bounds.check_kv_write and
    check_attention's array conditions)."""
    if slots.shape[0] != t or positions.shape[0] != t:
        return False
    for i in range(t):
        if slots[i] < -1 or slots[i] >= n_slots:
            return False
    n = ctx.shape[0]
    if qsl.shape[0] != n + 1 or tables.shape[0] != n:
        return False
    if n == 0:
        return True
    if qsl[0] != 0 or qsl[n] != t:
        return False
    longest = ctx[0]
    for i in range(n):
        count = qsl[i + 1] - qsl[i]
        if count < 0 or ctx[i] < count:
            return False
        longest = max(longest, ctx[i])
    if longest > tables.shape[1] * block_size:
        return False
    for i in range(n):
        for j in range(tables.shape[1]):
            if tables[i, j] < 0 or tables[i, j] >= n_blocks:
                return False
    return True
