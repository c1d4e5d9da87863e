"""BlockManager: the paged KV cache's bookkeeping. Blocks, reference counts and automatic prefix caching,
and for a model with recurrent layers each sequence's slot in the state pool (state_cache.py), taken
with its first blocks and given back with them.

A full block is keyed by a chained digest of (parent block's key, its token ids), rooted in the model
fingerprint (block_identity.py), so a hit on a block implies its whole prefix matches; tokens are
compared on a hit to rule out collisions. Freed blocks keep their contents and stay findable until they
are reused, least recently freed first. With a disk tier (`tier`, kv_disk.py), a block that memory
misses is looked for there and restored into a free block, and every block registered is handed to it.
With `events` set (kv_events.py), each block made findable and each one forgotten is logged for
KV-cache-aware routers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from localllm.engine.block_identity import block_hash
from localllm.engine.sequence import Sequence
from localllm.engine.state_cache import StateSlots, StateSnapshots

__all__ = ["Block", "BlockManager", "BlockTier", "block_hash"]


class BlockTier(Protocol):
    """A second level of the prefix cache by block key (kv_disk.KVDiskTier): the block manager restores
    blocks from there when memory misses, and hands it every block it registers."""

    stats: Any  # its counts, for monitoring (kv_disk.DiskStats)

    def load(self, key: bytes, token_ids: tuple[int, ...], block_id: int) -> bool:
        """Fill the pool's block `block_id` with the block keyed `key`; False (untouched) if it can't."""
        ...

    def store(self, key: bytes, token_ids: tuple[int, ...], block_id: int) -> None: ...

    def close(self) -> None:
        """Write out what is pending and stop (the engine is being closed)."""
        ...


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, fingerprint: bytes = b"",
        state_slots: StateSlots | None = None, snapshots: StateSnapshots | None = None,
    ):  # fmt: skip
        self.state_slots = state_slots
        self.snapshots = snapshots  # states at cached block boundaries (a model with recurrent layers)
        self.block_size = block_size
        self.fingerprint = fingerprint  # the first block's parent key: the model's (block_identity.py)
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found
        self.num_disk_hits = 0  # of which restored from the disk tier
        self.tier: BlockTier | None = None  # the disk tier (kv_disk.KVDiskTier), when one is on
        self.events: Any = None  # kv_events.KVEventLog: blocks stored and removed, for a router

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding a cached prefix of seq's tokens, in memory or restored from the disk tier;
        the last token is always left to compute so the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = None
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            parent = block_hash(parent, tokens, self.fingerprint)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None and self.tier is not None:
                block_id = self._restore(parent, tokens, found)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        if self.snapshots is not None:  # a recurrent state resumes only where a snapshot was kept
            keep = [i + 1 for i, b in enumerate(found) if self.snapshots.has(self.blocks[b].hash)]
            found = found[: max(keep, default=0)]
        return found

    def _restore(self, key: bytes, tokens: tuple[int, ...], found: list[int]) -> int | None:
        """A free block (never one of `found`) filled from the disk tier's file of `key`, kept free and
        findable, as the most recently freed; None if the tier lacks it or no block is free."""
        assert self.tier is not None
        keep = set(found)
        block_id = next((b for b in self.free_block_ids if b not in keep), None)
        if block_id is None or not self.tier.load(key, tokens, block_id):  # False: no file (or a bad one)
            return None
        block = self.blocks[self._forget(block_id)]
        block.hash, block.token_ids = key, tokens
        self.hash_to_block_id[key] = block_id
        self.free_block_ids.move_to_end(block_id)
        if self.events is not None:
            parent = self.blocks[found[-1]].hash if found else None
            self.events.stored([key], parent, list(tokens))
        self.num_disk_hits += self.block_size
        return block_id

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        """Grow seq's block table to hold num_computed + cached + new tokens; False if blocks run out."""
        cached_block_ids = cached_block_ids or []
        num_tokens = seq.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        need = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_block_ids)
        reusable = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if need > self.num_free_blocks - reusable:
            return False
        if self.state_slots is not None and seq.state_slot < 0:
            if not self.state_slots.num_free:
                return False
            seq.state_slot = self.state_slots.take()
            if cached_block_ids and self.snapshots is not None:
                self.snapshots.restore(self.blocks[cached_block_ids[-1]].hash, seq.state_slot)  # type: ignore[arg-type]
        for block_id in cached_block_ids:
            self._take(block_id)
            seq.block_table.append(block_id)
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take(self._evict_one()))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of seq that is full of computed tokens under its chained hash."""
        if not self.enable_prefix_caching:
            return
        start = self._hashed_prefix(seq)
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        new: list[int] = []  # indices of the blocks registered here, for BlockStored events
        full = seq.num_computed_tokens // self.block_size
        for i in range(start, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash, block.token_ids = block_hash(parent, tokens, self.fingerprint), tokens
                if self.hash_to_block_id.setdefault(block.hash, block.block_id) == block.block_id:
                    new.append(i)
                if self.tier is not None:
                    self.tier.store(block.hash, tokens, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(start, full)
        if new and self.events is not None:
            self._log_stored(seq, new)

    def _hashed_prefix(self, seq: Sequence) -> int:
        """How many leading blocks of seq already carry their hash: a block keeps it while a table
        holds it, so a step hashes only the blocks filled since the last (not the whole context)."""
        n = min(seq.num_hashed_blocks, len(seq.block_table))
        return n if n and self.blocks[seq.block_table[n - 1]].hash is not None else 0

    def _log_stored(self, seq: Sequence, new: list[int]) -> None:
        """One BlockStored per run of consecutive new blocks (indices into seq's block table), each
        naming the block before it as its parent."""
        start = 0
        for k in range(1, len(new) + 1):
            if k < len(new) and new[k] == new[k - 1] + 1:
                continue
            blocks = [self.blocks[seq.block_table[i]] for i in new[start:k]]
            first = new[start]
            parent = self.blocks[seq.block_table[first - 1]].hash if first else None
            tokens = [t for b in blocks for t in b.token_ids]
            self.events.stored([b.hash for b in blocks], parent, tokens)
            start = k

    def snapshot(self, seq: Sequence) -> None:
        """Keep seq's recurrent state when its computed tokens end on a cached block's boundary."""
        n, bs = seq.num_computed_tokens, self.block_size
        if self.snapshots is None or seq.state_slot < 0 or n == 0 or n % bs or len(seq.block_table) < n // bs:
            return
        key = self.blocks[seq.block_table[n // bs - 1]].hash
        if key is not None:
            self.snapshots.save(key, seq.state_slot, seq.snapshot_key)
            seq.snapshot_key = key

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, so a shared prefix is the last to be evicted. A block that
        no hash names (a partial tail, an embedding input's) holds nothing to find again: it goes to the
        front, to be reused before any cached prefix is evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.give(seq.state_slot)
        seq.state_slot = -1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first num_tokens tokens (a verify step's rejected drafts).
        They never held a full block of computed tokens, so no hash names them: they go to the front of
        the free list, to be reused first."""
        keep = self.blocks_needed(num_tokens)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, f"block {block_id} is shared or cached"
            self.free_block_ids[block_id] = None
            self.free_block_ids.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_prompt_tokens
        self.num_prefix_hits += num_hit_tokens

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1
        return block_id

    def _evict_one(self) -> int:
        """The least recently freed block, its cached contents forgotten."""
        return self._forget(next(iter(self.free_block_ids)))

    def _forget(self, block_id: int) -> int:
        """A free block no key finds any more (its contents are about to be overwritten)."""
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            if self.events is not None:
                self.events.removed(block.hash)
        block.hash, block.token_ids = None, ()
        return block_id
