"""The PyTorch backend: the shared decoder's operations as torch tensor ops on CUDA, Apple MPS or the CPU.

Weights are dequantized once at load to dense device tensors (the size is logged): float32 on the CPU,
so results track the NumPy oracle to float rounding (bf16 measured ~2x faster there on AVX512-BF16
CPUs, but it rounds every weight to an 8-bit mantissa); bf16 on CUDA where the card supports it (else
fp16) and fp16 on MPS: half the memory and the tensor cores, with activations, norms and attention in
float32. Keeping weights quantized on the device is not done yet.

The paged KV cache is a pair of device tensors (n_layers, num_blocks + 1, block_size, kv_heads,
head_dim), written through slot_mapping and read through the block tables by a gather; the extra block
is scratch for padding rows. `begin_step` uploads a step's index arrays once and plans its attention on
the host (which tokens decode, how long each context is), so no layer reads a device value back. On
CUDA, decode-only steps run a fixed-shape copy of the stack captured as CUDA graphs (`run_layers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from localllm.backends.base import Backend
from localllm.backends.threads import ModelGovernors, ThreadGovernor
from localllm.errors import ConfigError
from localllm.models.base import ForwardBatch
from localllm.models.layers import decoder_layer
from localllm.models.spec import LayerSpec, RopeSpec
from localllm.quant import dequantize

if TYPE_CHECKING:
    from localllm.models.base import PagedKV
    from localllm.models.layers import LayerWeights
    from localllm.models.transformer import Transformer

log = logging.getLogger("localllm")

DEVICES = ("auto", "cuda", "mps", "cpu")
MAX_STATIC_BATCH = 64  # decode batches up to this many sequences take the static (graph) path
CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto: CUDA, then MPS, then the CPU; an explicit device that is not there is refused in one line."""
    if name not in DEVICES:
        raise ConfigError(f"unknown device '{name}' (choose {', '.join(DEVICES)})")
    has = {"cuda": torch.cuda.is_available(), "mps": _has_mps(), "cpu": True}
    if name == "auto":
        name = next(d for d in ("cuda", "mps", "cpu") if has[d])
    if not has[name]:
        raise ConfigError(f"--device {name}: this PyTorch build sees no {name.upper()} device")
    return torch.device(name)


def _has_mps() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def weight_dtype(device: torch.device) -> torch.dtype:
    """The dense weight type per device (see the module docstring for why)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if device.type == "mps" else torch.float32


def _owned(a: np.ndarray) -> np.ndarray:
    """A contiguous, writable float32 array: an F32 tensor dequantizes to a view of the read-only
    memory map, which torch refuses to wrap without a copy."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a if a.flags.writeable else a.copy()


@dataclass(slots=True)
class _Group:
    """Sequences attended together, each with Q queries: all decodes (Q = 1), or one prefill chunk
    (S = 1), so no query row is padding. `tokens` (S*Q,) are their rows of q, at positions `q_pos`
    (S, Q); keys up to `n_keys` are read through `tables` (S, blocks)."""

    tokens: torch.Tensor
    q_pos: torch.Tensor
    ctx: torch.Tensor  # (S,) context length after this step
    tables: torch.Tensor
    n_keys: int


@dataclass(slots=True)
class _StaticDecode:
    """A decode step's layer stack over fixed buffers: B sequences (padding rows write to a scratch
    slot past the pool) and W blocks of keys each. On CUDA it is captured once as a graph and replayed;
    elsewhere the same code runs eagerly, which is how the tests check it."""

    x: torch.Tensor  # (B, dim)
    positions: torch.Tensor  # (B,)
    slots: torch.Tensor  # (B,)
    tables: torch.Tensor  # (B, W)
    ctx: torch.Tensor  # (B,)
    scratch: int  # the slot padding rows write
    run: Callable[[], torch.Tensor] | None = None
    keep: list[Any] = field(default_factory=list)  # tensors a graph reads that Python must keep alive


def _bucket(n: int, floor: int = 1) -> int:
    """The power of two >= n (at least floor): few shapes, so few graphs."""
    return max(floor, 1 << max(0, n - 1).bit_length())


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, threads: int = 0, device: str = "auto"):
        self.device = resolve_device(device)
        self.dtype = weight_dtype(self.device)
        # On the CPU, each step's thread count is learned from step times, as the Numba backend does
        # (threads.py): a busy core makes torch's parallel regions wait, 2 threads slower than 1.
        self._governors = ModelGovernors(threads or torch.get_num_threads())  # used on the CPU only
        self.threads = torch.get_num_threads()
        self._step: tuple[int, int, float, ThreadGovernor] | None = None  # (tokens, threads, start, governor)
        self.weight_bytes = 0
        self._rope_tables: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: list[_Group] = []
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self._max_pos = 0
        self._host: ForwardBatch | None = None  # this step's batch as the engine gave it (NumPy)
        # Decode steps over fixed shapes, replayed as CUDA graphs (on by default on CUDA only: on the CPU
        # and MPS nothing is captured, and the paged path reads fewer keys).
        self.static_decode = self.device.type == "cuda"
        self.cuda_graphs = True  # off: the static stack runs eagerly on CUDA too (tests compare the two)
        self._static: dict[tuple[int, int], _StaticDecode] = {}
        self._static_batch: ForwardBatch | None = None  # set while a static stack runs
        self._graph_pool: Any = None

    # ---- weights and memory ---------------------------------------------------------------------

    def prepare_weight(self, raw: np.ndarray, ggml_type: int, cache: Any = None) -> torch.Tensor:
        w = torch.from_numpy(_owned(dequantize(raw, ggml_type)))
        w = w.to(self.device, self.dtype)
        self.weight_bytes += w.numel() * w.element_size()
        return w

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> torch.Tensor:
        return torch.from_numpy(_owned(dequantize(raw, ggml_type)).reshape(-1)).to(self.device)

    def numerics(self) -> str:
        """torch's version, the device and the weights' dtype (engine/block_identity.py)."""
        return f"torch {torch.__version__}|{self.device}|{self.dtype}"

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # one block more than the engine's pool: the scratch block static decode's padding rows write
        shape = (n_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        k, v = (torch.zeros(shape, dtype=CACHE_DTYPES[t], device=self.device) for t in cache_types)
        return k, v

    def kv_block_to_host(self, pool: torch.Tensor, block_id: int) -> np.ndarray:
        return pool[:, block_id].cpu().numpy()  # the pool's dtype (to_numpy would widen to float32)

    def kv_block_from_host(self, pool: torch.Tensor, block_id: int, data: np.ndarray) -> None:
        pool[:, block_id].copy_(torch.from_numpy(np.array(data)))  # a writable copy: data may be mapped

    def warmup(self, model: Transformer, cache_types: tuple[str, str] = ("f32", "f32")) -> None:
        """Nothing to compile; say where the weights went and what they take."""
        log.info(
            "torch backend: %.0f MiB of %s weights on %s",
            self.weight_bytes / 2**20, str(self.dtype).removeprefix("torch."), self.device,
        )  # fmt: skip

    # ---- the step's batch -----------------------------------------------------------------------

    def begin_step(self, batch: ForwardBatch, model: Transformer) -> ForwardBatch:
        """Upload the index arrays once, and plan attention from the host copies (no device reads)."""
        self._masks.clear()
        self._host = batch
        self._start_step(len(batch.input_ids), self.thread_governor(model))
        self._max_pos = int(batch.positions.max()) if len(batch.positions) else 0
        static = self.static_decode and _static_eligible(batch)
        self._groups = (
            [] if static else self._plan(batch.query_start_loc, batch.context_lens, batch.block_tables)
        )

        def up(a: np.ndarray) -> Any:  # a device tensor where ForwardBatch's types name host arrays
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

        return replace(
            batch, input_ids=up(batch.input_ids), positions=up(batch.positions),
            slot_mapping=up(batch.slot_mapping), logits_indices=up(batch.logits_indices),
        )  # fmt: skip

    def _plan(self, qsl: np.ndarray, ctx: np.ndarray, tables: np.ndarray) -> list[_Group]:
        """One group for all single-query sequences (decodes), one per multi-query sequence (prefill
        chunks): padding decodes to a shared key length is cheap, padding prefills to each other is not."""
        qlens = np.diff(qsl)
        decodes = np.flatnonzero(qlens == 1)
        groups = [self._group(qsl, ctx, tables, decodes, 1)] if len(decodes) else []
        for s in np.flatnonzero(qlens > 1):
            groups.append(self._group(qsl, ctx, tables, np.array([s]), int(qlens[s])))
        return groups

    def _group(
        self, qsl: np.ndarray, ctx: np.ndarray, tables: np.ndarray, seqs: np.ndarray, q: int
    ) -> _Group:
        lens = ctx[seqs]
        offsets = np.arange(q)[None, :]

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

        return _Group(
            tokens=dev((qsl[seqs][:, None] + offsets).reshape(-1)), q_pos=dev(lens[:, None] - q + offsets),
            ctx=dev(lens), tables=dev(tables[seqs]), n_keys=int(lens.max()),
        )  # fmt: skip

    def run_layers(self, model: Transformer, x: Any, batch: ForwardBatch, kv: PagedKV) -> Any | None:
        """Decode-only steps through a fixed-shape stack (a CUDA graph on CUDA) when static_decode is on;
        else None, and the model runs its layers op by op over the paged path."""
        if not self.static_decode:
            return None
        if any(s.experts for s in model.args.layers):  # routing reads the device: no fixed-shape graph
            h = self._host  # (begin_step planned attention for the static stack; plan the paged path)
            self._groups = self._plan(h.query_start_loc, h.context_lens, h.block_tables) if h else []
            return None
        return _static_run_layers(self, model, x, kv)

    # ---- operations -----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(weight.dtype), weight).float()

    def embedding(self, weight: torch.Tensor, ids: Any) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):  # a caller outside a step (tests, tools)
            ids = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)
        return weight[ids].float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def geglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    # ---- mixture of experts (kernels/moe_reference.py's computation, in torch) -----------------

    runs_moe = True

    def moe_ffn(self, h: torch.Tensor, lw: LayerWeights, spec: LayerSpec) -> torch.Tensor:
        """Each routed expert on its tokens only; the routing waits for the device (the static
        decode stack is not used for mixture-of-experts models, see run_layers)."""
        probs = torch.softmax(self.linear(h, lw.router).float(), dim=-1)
        weights, ids = torch.topk(probs, spec.experts_used, dim=-1)
        if spec.expert_renorm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for e in ids.unique().tolist():
            t, j = torch.nonzero(ids == e, as_tuple=True)
            x = h[t]
            act = self.swiglu(self.linear(x, lw.gate_exps[e]), self.linear(x, lw.up_exps[e]))
            out.index_add_(0, t, self.linear(act, lw.down_exps[e]) * weights[t, j, None])
        return out

    def sigmoid_gate(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h.float() @ weight)[:, None]

    def to_numpy(self, x: Any) -> np.ndarray:
        out = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)
        if self._step is not None:  # the step's logits: it is over
            tokens, threads, start, governor = self._step
            governor.record(tokens, threads, time.perf_counter() - start)
        self._step = None
        return out

    def thread_governor(self, model: Transformer) -> ThreadGovernor | None:
        """On the CPU, as the Numba backend's; a device's thread count is not the host's to tune."""
        return self._governors.of(model) if self.device.type == "cpu" else None

    def _start_step(self, n_tokens: int, governor: ThreadGovernor | None) -> None:
        if governor is None:
            return
        n = governor.choose(n_tokens)
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
        self._step = (n_tokens, n, time.perf_counter(), governor)

    # ---- RoPE and the paged cache ---------------------------------------------------------------

    def _cos_sin(self, rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every position up to this step's largest, per rotation, rounded to float32 once
        from float64 angles as the reference does; grown by doubling, so a long generation rebuilds it
        log(n) times."""
        have = self._rope_tables.get(rope)
        if have is not None and have[0].shape[0] > self._max_pos:
            return have
        n = max(256, 1 << int(self._max_pos).bit_length())
        angles = np.arange(n, dtype=np.float64)[:, None] * rope.frequencies()[None, :]
        mscale = rope.mscale()
        cos, sin = ((f(angles) * mscale).astype(np.float32) for f in (np.cos, np.sin))
        table = (torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device))
        self._rope_tables[rope] = table
        return table

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
        """x (T, heads, D) rotated on its first rope.dim dims: NEOX halves or adjacent pairs."""
        x = x.float()
        out = x.clone()
        d, half = rope.dim, rope.dim // 2
        a, b = (x[..., :half], x[..., half:d]) if rope.neox else (x[..., 0:d:2], x[..., 1:d:2])
        ra, rb = a * cos - b * sin, a * sin + b * cos
        if rope.neox:
            out[..., :half], out[..., half:d] = ra, rb
        else:
            out[..., 0:d:2], out[..., 1:d:2] = ra, rb
        return out

    def rope_store_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rope: RopeSpec,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        cos_t, sin_t = self._cos_sin(rope)
        cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]
        q, k = self._rope(q, cos, sin, rope), self._rope(k, cos, sin, rope)
        nb, bs = k_cache.shape[:2]
        k_cache.view(nb * bs, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(nb * bs, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)
        return q, k

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: Any,
        context_lens: Any, block_tables: Any, scale: float, window: int = 0, softcap: float = 0.0,
    ) -> torch.Tensor:  # fmt: skip
        """Causal grouped-query attention over the paged cache, per the step's plan (begin_step); the
        index arguments are the plan's source and are not read again here."""
        if self._static_batch is not None:
            g = self._static_group(self._static_batch, k_cache.shape[1])
            return self._attend_group(q, k_cache, v_cache, g, self._mask(-1, g, window), scale, softcap)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i, g in enumerate(self._groups):
            rows = self._attend_group(q, k_cache, v_cache, g, self._mask(i, g, window), scale, softcap)
            out[g.tokens] = rows
        return out

    def _static_group(self, batch: ForwardBatch, block_size: int) -> _Group:
        """The static batch as one decode group over all W blocks of every table (device values only)."""
        dev: Any = batch  # device tensors under ForwardBatch's host-array types (see begin_step)
        b, w = dev.block_tables.shape
        tokens = torch.arange(b, device=self.device)
        q_pos = (dev.context_lens - 1)[:, None]
        return _Group(tokens, q_pos, dev.context_lens, dev.block_tables, w * block_size)

    def _mask(self, i: int, g: _Group, window: int) -> torch.Tensor:
        """(S, 1, 1, Q, L) keys each query sees: its own and earlier positions, within `window`."""
        key = (i, window)
        if key not in self._masks:
            k_pos = torch.arange(g.n_keys, device=self.device)[None, None, :]
            q_pos = g.q_pos[:, :, None]
            mask = (k_pos <= q_pos) & (k_pos < g.ctx[:, None, None])
            if window > 0:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask[:, None, None, :, :]
        return self._masks[key]

    def _attend_group(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group, mask: torch.Tensor,
        scale: float, softcap: float,
    ) -> torch.Tensor:  # fmt: skip
        """(S*Q, H, D) attention outputs of the group's (padded) query rows."""
        n_heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
        s, nq = g.q_pos.shape
        # (S, KVH, G, Q, D): query head h reads kv head h // G, as the reference groups them
        qg = q[g.tokens].float().view(s, nq, kv_heads, n_heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
        keys, values = (self._gather(c, g) for c in (k_cache, v_cache))  # (S, KVH, 1, L, D)
        if softcap > 0:
            out = _softcapped_attention(qg, keys, values, mask, scale, softcap)
        else:
            out = _sdpa(qg, keys, values, mask, scale)
        return out.permute(0, 3, 1, 2, 4).reshape(s * nq, n_heads, dim)

    @staticmethod
    def _gather(cache: torch.Tensor, g: _Group) -> torch.Tensor:
        """The group's first n_keys positions, read through its block tables -> (S, KVH, 1, L, D)."""
        bs = cache.shape[1]
        n_blocks = -(-g.n_keys // bs)
        blocks = cache[g.tables[:, :n_blocks]]  # (S, n_blocks, bs, KVH, D)
        s = blocks.shape[0]
        seq = blocks.reshape(s, n_blocks * bs, *cache.shape[2:])[:, : g.n_keys].float()
        return seq.permute(0, 2, 1, 3)[:, :, None]


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float,
) -> torch.Tensor:  # fmt: skip
    """Scores through cap * tanh(score / cap) before the softmax (gemma2), which SDPA cannot do."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values)


def _sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (S, KVH, G, Q, D) against keys/values (S, KVH, 1, L, D) through torch's fused attention: the G
    query heads sharing a kv head become G*Q rows of it, so no key is copied per head."""
    s, kvh, group, nq, dim = q.shape
    rows = mask.expand(s, 1, group, nq, mask.shape[-1]).reshape(s, 1, group * nq, -1)
    out = F.scaled_dot_product_attention(
        q.reshape(s, kvh, group * nq, dim), keys[:, :, 0], values[:, :, 0], attn_mask=rows, scale=scale
    )
    return out.view(s, kvh, group, nq, dim)


# ---- decode over fixed shapes (CUDA graphs) ---------------------------------------------------------


def _static_run_layers(
    b: TorchBackend, model: Transformer, x: torch.Tensor, kv: PagedKV
) -> torch.Tensor | None:
    """A decode-only step (one query per sequence, at most MAX_STATIC_BATCH) through the static stack of
    its (batch, key blocks) bucket, built on first use; None for any other step (the paged path)."""
    host = b._host
    if host is None or not _static_eligible(host):
        return None
    s, width = len(host.context_lens), host.block_tables.shape[1]
    key = (_bucket(s), _bucket(width, 4))
    entry = b._static.get(key) or _build_static(b, model, kv, key)
    _load_static(b, entry, x, host)
    assert entry.run is not None
    return entry.run()[:s]


def _static_eligible(host: ForwardBatch) -> bool:
    """Decode only (one query per sequence), and few enough sequences for a captured bucket."""
    return len(host.input_ids) == len(host.context_lens) <= MAX_STATIC_BATCH


def _build_static(b: TorchBackend, model: Transformer, kv: PagedKV, key: tuple[int, int]) -> _StaticDecode:
    n, width = key
    dev, bs = b.device, kv.block_size
    scratch = kv.num_blocks * bs  # the extra block allocate_kv added
    entry = _StaticDecode(
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


def _static_layers(b: TorchBackend, model: Transformer, kv: PagedKV, entry: _StaticDecode) -> torch.Tensor:
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


def _load_static(b: TorchBackend, entry: _StaticDecode, x: torch.Tensor, host: ForwardBatch) -> None:
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
    for buf, a in ((entry.tables, tables), (entry.ctx, ctx), (entry.positions, pos), (entry.slots, slots)):
        buf.copy_(torch.from_numpy(a), non_blocking=False)


def _capture(b: TorchBackend, stack: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
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
