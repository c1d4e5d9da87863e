"""Decode steps over fixed shapes: a decode-only batch padded to a (sequences, key blocks) bucket runs a
layer stack that reads only fixed buffers, so on CUDA it is captured once as a graph and replayed.
Elsewhere the same stack runs eagerly, which is how the tests check it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from localllm.backends.torch_backend.uploads import upload_ints
from localllm.models.batch import ForwardBatch
from localllm.models.layers import decoder_layer

log = logging.getLogger("localllm")

MAX_STATIC_BATCH = 64  # decode batches up to this many sequences take the static (graph) path

# The backend (backend.py's TorchBackend) and model as this module sees them: naming their classes
# would be an import cycle (backend.py imports this module).
Backend = Any
Transformer = Any
PagedKV = Any


@dataclass(slots=True)
class StaticDecode:
    """A decode step's layer stack over fixed buffers: B sequences (padding rows write to a scratch
    slot past the pool) and W blocks of keys each."""

    x: torch.Tensor  # (B, dim)
    positions: torch.Tensor  # (B,)
    slots: torch.Tensor  # (B,)
    tables: torch.Tensor  # (B, W)
    ctx: torch.Tensor  # (B,)
    scratch: int  # the slot padding rows write
    run: Callable[[], torch.Tensor] | None = None
    keep: list[Any] = field(default_factory=list)  # tensors a graph reads that Python must keep alive


def bucket(n: int, floor: int = 1) -> int:
    """The power of two >= n (at least floor): few shapes, so few graphs."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def static_eligible(host: ForwardBatch) -> bool:
    """Decode only (one query per sequence), and few enough sequences for a captured bucket."""
    return len(host.input_ids) == len(host.context_lens) <= MAX_STATIC_BATCH


def static_run_layers(b: Backend, model: Transformer, x: torch.Tensor, kv: PagedKV) -> torch.Tensor | None:
    """A decode-only step (one query per sequence, at most MAX_STATIC_BATCH) through the static stack of
    its (batch, key blocks) bucket, built on first use; None for any other step (the paged path)."""
    host = b._host
    if host is None or not static_eligible(host):
        return None
    s, width = len(host.context_lens), host.block_tables.shape[1]
    key = (bucket(s), bucket(width, 4))
    entry = b._static.get(key) or _build_static(b, model, kv, key)
    _load_static(entry, x, host)
    assert entry.run is not None
    return entry.run()[:s]


def _build_static(b: Backend, model: Transformer, kv: PagedKV, key: tuple[int, int]) -> StaticDecode:
    n, width = key
    dev, bs = b.device, kv.block_size
    scratch = kv.num_blocks * bs  # the extra block allocate_kv added
    entry = StaticDecode(
        x=torch.zeros(n, model.args.dim, device=dev), positions=torch.zeros(n, dtype=torch.int64, device=dev),
        slots=torch.full((n,), scratch, dtype=torch.int64, device=dev),
        tables=torch.zeros(n, width, dtype=torch.int64, device=dev),
        ctx=torch.ones(n, dtype=torch.int64, device=dev), scratch=scratch,
    )  # fmt: skip
    # RoPE tables must cover every position the buffers can hold before anything is captured
    b._max_pos = max(b._max_pos, width * bs)
    entry.keep = [b._cos_sin(spec.rope) for spec in model.args.layers]

    def stack() -> torch.Tensor:
        return _static_layers(b, model, kv, entry)

    entry.run = stack
    if dev.type == "cuda" and b.cuda_graphs:
        try:
            entry.run = _capture(b, stack)
        except RuntimeError as e:  # a capture this build or driver refuses: the same stack, eagerly
            log.warning("torch backend: CUDA graph capture failed (%s); decoding without graphs", e)
    b._static[key] = entry
    return entry


def _static_layers(b: Backend, model: Transformer, kv: PagedKV, entry: StaticDecode) -> torch.Tensor:
    """Every layer on entry.x, reading only entry's buffers (so a captured graph replays correctly)."""
    e: Any = entry  # its device tensors stand where ForwardBatch's types name host arrays
    batch = ForwardBatch(
        input_ids=e.positions, positions=e.positions, slot_mapping=e.slots,
        query_start_loc=e.positions, context_lens=e.ctx, block_tables=e.tables,
        logits_indices=e.positions,
    )  # fmt: skip
    saved, b._masks, b._static_batch = b._masks, {}, batch  # masks built here belong to this run
    try:
        x = entry.x
        for il, lw in enumerate(model.layers):
            x = decoder_layer(b, model.args, il, lw, x, batch, kv)
        return x
    finally:
        b._masks, b._static_batch = saved, None


def _load_static(entry: StaticDecode, x: torch.Tensor, host: ForwardBatch) -> None:
    """This step's decode batch into entry's buffers; padding rows attend to one key and write scratch."""
    s, (n, width) = x.shape[0], entry.tables.shape
    tables = np.zeros((n, width), np.int64)
    tables[:s, : host.block_tables.shape[1]] = host.block_tables
    ctx = np.ones(n, np.int64)
    ctx[:s] = host.context_lens
    pos = np.zeros(n, np.int64)
    pos[:s] = host.positions
    slots = np.full(n, entry.scratch, np.int64)
    slots[:s] = host.slot_mapping
    entry.x[:s].copy_(x)
    entry.x[s:].zero_()
    bufs = (entry.tables, entry.ctx, entry.positions, entry.slots)
    for buf, a in zip(
        bufs, upload_ints([tables, ctx, pos, slots], entry.x.device), strict=True
    ):  # one copy up
        buf.copy_(a)


def _capture(b: Backend, stack: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """UNTESTED on real hardware: stack captured as a CUDA graph (warmed up on a side stream first, as
    capture requires), replayed per step. Every buffer it reads is static; the output tensor is reused."""
    if b._graph_pool is None:
        b._graph_pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # allocator and cuBLAS workspaces settle outside the graph
            stack()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=b._graph_pool):
        out = stack()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay
