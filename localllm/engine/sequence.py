"""Sequence: one request's tokens, block table and progress (pure bookkeeping, no arrays)."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import Any

from localllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        rng: Any = None,
        group: str | None = None,
    ):
        self.request_id = request_id
        self.group = group or request_id  # sequences of one client request (its n choices) share it
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.rng = rng  # per-request generator, owned by the sampler side
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table known to carry their hash
        self.state_slot = -1  # its slot in the recurrent state pool (state_cache.py), -1: none
        self.snapshot_key: bytes | None = None  # the block hash its last state snapshot is kept under
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at first admission
        self.num_preemptions = 0
        self.admitted = False
        self.finish_reason: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.constraint: Any = None  # structured.matcher.Constraint when params.structured is set
        self.forced: list[int] = []  # tokens the next steps emit instead of sampling (a reasoning budget)
        self.held_stops: list[int] = []  # stop token ids that may not come before params.min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.name})"
        )
