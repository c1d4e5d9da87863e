"""The recurrent state pool: what a sequence carries from token to token in layers that keep a state
instead of (or besides) keys and values, beside the paged KV cache of the attention layers.

A layer's LayerSpec names its state tensors (`state_shapes`: a Gated DeltaNet's conv window and
delta-rule matrix; a Mamba layer's would be its conv window and SSM state), so this pool knows no
architecture. It holds `num_slots` sequences' worth, float32, sized at start-up (one slot per
sequence the scheduler may run, and one for scoring beside them). A slot is taken by the block
manager when a sequence first gets blocks and given back when its blocks are freed: on finish, abort,
and preemption, after which the sequence is recomputed from its first token (the rule: a state is
never saved, a preempted sequence's prompt and output so far are prefilled again). Kernels start a
sequence whose first token in a step is at position 0 from zeros, so a slot is never cleared.

Prefix caching: a cached block holds keys and values, not the state after it, so the block manager
reuses a cached prefix only up to a block boundary where a snapshot of the state was kept
(`StateSnapshots`). The rule: whenever a step leaves a sequence's computed tokens on a block boundary
(a decode step every block_size tokens, a prefill chunk that ends on one), the state there is copied
into a snapshot keyed by that block's chained hash, replacing the sequence's previous snapshot; the
least recently used snapshot is recycled. A second chat turn, whose prompt repeats the first turn's
prompt and reply, resumes from the last boundary of that reply.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from localllm.backends.memory import lazy_zeros

if TYPE_CHECKING:
    from localllm.models.spec import ModelArgs


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Which layers keep a state, and each one's state tensors (name, shape), float32."""

    layers: tuple[int, ...]
    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, args: ModelArgs) -> StateLayout | None:
        """The model's state layout, None when no layer is recurrent."""
        found = [(il, s.state_shapes()) for il, s in enumerate(args.layers) if s.recurrent]
        if not found:
            return None
        if len({shapes for _, shapes in found}) != 1:
            raise ValueError("recurrent layers with different state shapes share no pool layout")
        return cls(tuple(il for il, _ in found), found[0][1])

    @property
    def bytes_per_sequence(self) -> int:
        return 4 * len(self.layers) * sum(math.prod(shape) for _, shape in self.tensors)


class StateSlots:
    """The pool's bookkeeping: which slots are free (no arrays)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)


class StateCache:
    """The pool's arrays: per state tensor, (recurrent layers, slots, *shape) float32; zero pages until
    a sequence writes them."""

    def __init__(self, layout: StateLayout, num_slots: int):
        self.layout = layout
        self.num_slots = num_slots
        n = len(layout.layers)
        # without huge pages: NumPy asks for them on large arrays, and a slot's 1 MiB of a layer would
        # then make 2-4 MiB resident
        self.arrays = tuple(lazy_zeros((n, num_slots, *shape), np.float32) for _, shape in layout.tensors)
        self._index = {il: j for j, il in enumerate(layout.layers)}

    @property
    def nbytes(self) -> int:
        return self.layout.bytes_per_sequence * self.num_slots

    def layer(self, il: int) -> tuple[np.ndarray, ...]:
        """Layer il's state tensors, each (slots, *shape)."""
        j = self._index[il]
        return tuple(a[j] for a in self.arrays)


def pool_slots(max_num_seqs: int) -> int:
    """Sequences the pool holds: every one the scheduler may run, and one for scoring beside them."""
    return max_num_seqs + 1


def snapshot_slots(max_num_seqs: int) -> int:
    """Snapshots kept for prefix caching: half a sequence each on average, at least two."""
    return max(2, max_num_seqs // 2)


class StateSnapshots:
    """States at block boundaries, keyed by the block's chained hash (see the module docstring)."""

    def __init__(self, cache: StateCache, num_snapshots: int):
        self.cache = cache
        self.num_snapshots = num_snapshots
        n = len(cache.layout.layers)
        self.arrays = tuple(lazy_zeros((n, num_snapshots, *a.shape[2:]), np.float32) for a in cache.arrays)
        self._where: OrderedDict[bytes, int] = OrderedDict()  # key -> snapshot index, least recent first
        self._free = list(range(num_snapshots - 1, -1, -1))
        self.saved = self.restored = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def has(self, key: bytes | None) -> bool:
        return key is not None and key in self._where

    def save(self, key: bytes, slot: int, replaces: bytes | None = None) -> None:
        """Keep slot's state under key; `replaces`: the key this sequence saved before, now dropped."""
        if replaces is not None and replaces != key and replaces in self._where:
            self._free.append(self._where.pop(replaces))
        if key in self._where:
            self._where.move_to_end(key)
            return
        index = self._free.pop() if self._free else self._where.pop(next(iter(self._where)))
        for snap, live in zip(self.arrays, self.cache.arrays, strict=True):
            snap[:, index] = live[:, slot]
        self._where[key] = index
        self.saved += 1

    def restore(self, key: bytes, slot: int) -> None:
        """Copy the state kept under key into slot."""
        index = self._where[key]
        self._where.move_to_end(key)
        for snap, live in zip(self.arrays, self.cache.arrays, strict=True):
            live[:, slot] = snap[:, index]
        self.restored += 1
