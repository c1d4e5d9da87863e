"""The recurrent state pool (engine/state_cache.py) holds resident only the slots sequences wrote."""

from __future__ import annotations

import os

import numpy as np
import pytest
from resident import resident_kib

from localllm.engine.state_cache import StateCache, StateLayout, StateSnapshots

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps"
)


def test_one_slot_makes_only_its_pages_resident() -> None:
    """Layer-major pools: one slot is 64 KiB per layer.  With NumPy's huge pages each layer's write
    would hold 2-4 MiB (qwen35's 0.8B shape: 36 MiB more for one sequence's 18 MiB of state)."""
    layout = StateLayout(layers=(0, 1, 2, 3), tensors=(("ssm", (4, 64, 64)),))
    cache = StateCache(layout, num_slots=64)
    (ssm,) = cache.arrays
    assert ssm.nbytes == 16 * 2**20 and resident_kib(ssm) < 64
    for il in layout.layers:
        cache.layer(il)[0][3] = 1.0
    slot_kib = 4 * ssm[0, 0].nbytes // 1024
    assert slot_kib <= resident_kib(ssm) <= slot_kib + 64
    snaps = StateSnapshots(cache, 32)
    before = resident_kib(snaps.arrays[0])  # (adjacent anonymous mappings may merge with the pool's)
    snaps.save(b"k", 3)
    assert slot_kib <= resident_kib(snaps.arrays[0]) - before <= slot_kib + 64
    snaps.restore(b"k", 5)
    assert np.array_equal(ssm[:, 5], ssm[:, 3])
