"""The PyTorch backend: the shared decoder's operations as torch tensor ops on CUDA, Apple MPS or the CPU.

Weights (weights.py, qlinear.py): on a GPU the GGUF blocks of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K and MXFP4 (gpt-oss's experts) matrices stay quantized on the device and are dequantized inside
the matmul (Triton kernels on CUDA, chunks of torch ops on MPS or where Triton is absent), with the
NumPy oracle's values; other types, and every matrix on the CPU, are dequantized once to dense
tensors: float32 on the CPU; on CUDA the file's own float type (F32, F16, BF16), else bf16 where the
card has it (else fp16); fp16 on MPS (device.py). LOCALLLM_TORCH_WEIGHTS=dense or
quantized overrides the choice. Activations, norms and attention run in float32.

The paged KV cache is a pair of device tensors (n_layers, num_blocks + 1, block_size, kv_heads,
head_dim), written through slot_mapping and read through the block tables by a gather (attention.py);
the extra block is scratch for padding rows. `begin_step` uploads a step's index arrays once and plans
its attention on the host (which tokens decode, how long each context is), so no layer reads a device
value back. On CUDA, decode-only steps run a fixed-shape copy of the stack captured as CUDA graphs
(static.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from localllm.backends.base import Backend, Sampled, SampleRow
from localllm.backends.kv_types import row_width
from localllm.backends.threads import ModelGovernors, ThreadGovernor
from localllm.backends.torch_backend import attention, kv_q8, static
from localllm.backends.torch_backend.device import dense_dtype, resolve_device, weight_dtype
from localllm.backends.torch_backend.qlinear import QuantLinear, WeightMemory, weight_mode
from localllm.backends.torch_backend.sampling import sample_batch
from localllm.backends.torch_backend.uploads import upload_ints
from localllm.backends.torch_backend.weights import QuantWeight, dequantize_torch, keeps_quantized, upload
from localllm.errors import ConfigError
from localllm.models.batch import ForwardBatch
from localllm.models.spec import OAI_ALPHA, OAI_LIMIT, LayerSpec, RopeSpec
from localllm.quant import dequantize

if TYPE_CHECKING:
    from localllm.models.batch import PagedKV
    from localllm.models.layers import LayerWeights
    from localllm.models.transformer import Transformer

log = logging.getLogger("localllm")

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.int8}  # q8_0: block bytes
# an explicit alias: where torch is not installed mypy reads torch.Tensor as Any, and a plain
# assignment would then be a variable, not a type
Weight: TypeAlias = torch.Tensor | QuantWeight


def _owned(a: np.ndarray) -> np.ndarray:
    """A contiguous, writable float32 array: an F32 tensor dequantizes to a view of the read-only
    memory map, which torch refuses to wrap without a copy."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a if a.flags.writeable else a.copy()


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, threads: int = 0, device: str = "auto", weights: str = ""):
        self.device = resolve_device(device)
        self.dtype = weight_dtype(self.device)
        self.weights = weight_mode(self.device, weights)  # dense, or quantized (see qlinear.py)
        self.qlinear = QuantLinear(self.device, torch.float32 if self.device.type == "cpu" else self.dtype)
        self.memory = WeightMemory()
        # the engine draws each step's tokens here, so the logits stay on the device (not on the CPU:
        # the host sampler reads them in place there)
        self.samples_on_device = self.device.type != "cpu"
        # On the CPU, each step's thread count is learned from step times, as the Numba backend does
        # (threads.py): a busy core makes torch's parallel regions wait, 2 threads slower than 1.
        self._governors = ModelGovernors(threads or torch.get_num_threads())  # used on the CPU only
        self.threads = torch.get_num_threads()
        self._step: tuple[int, int, float, ThreadGovernor] | None = None  # (tokens, threads, start, governor)
        self._rope_tables: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: list[attention.Group] = []
        self._pool_blocks = 1  # blocks in each layer's slab of the KV pools (allocate_kv)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self._max_pos = 0
        self._host: ForwardBatch | None = None  # this step's batch as the engine gave it (NumPy)
        # Decode steps over fixed shapes, replayed as CUDA graphs (on by default on CUDA only: on the CPU
        # and MPS nothing is captured, and the paged path reads fewer keys).
        self.static_decode = self.device.type == "cuda"
        self.cuda_graphs = True  # off: the static stack runs eagerly on CUDA too (tests compare the two)
        self._static: dict[tuple[int, int], static.StaticDecode] = {}
        self._static_batch: ForwardBatch | None = None  # set while a static stack runs
        self._graph_pool: Any = None

    # ---- weights and memory ---------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        return self.memory.total

    def prepare_weight(self, raw: np.ndarray, ggml_type: int, cache: Any = None) -> Weight:
        """The GGUF's blocks as they are where this backend keeps them quantized, else a dense tensor."""
        if self.weights == "quantized" and keeps_quantized(ggml_type):
            q = upload(raw, ggml_type, self.device)
            self.memory.add(q.qtype, q.nbytes)
            return q
        dtype = dense_dtype(self.device, ggml_type)
        w = torch.from_numpy(_owned(dequantize(raw, ggml_type))).to(self.device, dtype)
        self.memory.add(str(dtype).removeprefix("torch."), w.numel() * w.element_size())
        return w

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> torch.Tensor:
        return torch.from_numpy(_owned(dequantize(raw, ggml_type)).reshape(-1)).to(self.device)

    def numerics(self) -> str:
        """torch's version, the device and the weights' dtype (engine/block_identity.py)."""
        return f"torch {torch.__version__}|{self.device}|{self.dtype}"

    def kv_block_to_host(self, pool: torch.Tensor, block_id: int) -> np.ndarray:
        return pool[:, block_id].cpu().numpy()  # the pool's dtype (to_numpy would widen to float32)

    def kv_block_from_host(self, pool: torch.Tensor, block_id: int, data: np.ndarray) -> None:
        pool[:, block_id].copy_(torch.from_numpy(np.array(data)))  # a writable copy: data may be mapped

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if unsupported := [t for t in cache_types if t not in CACHE_DTYPES]:
            raise ConfigError(f"the torch backend has no {unsupported[0]} KV cache: use f16 or f32, or numba")
        # one block more than the engine's pool: the scratch block static decode's padding rows write
        self._pool_blocks = num_blocks + 1
        shape = (n_layers, num_blocks + 1, block_size, kv_heads)
        k, v = (
            torch.zeros((*shape, row_width(t, head_dim)), dtype=CACHE_DTYPES[t], device=self.device)
            for t in cache_types
        )
        return k, v

    def warmup(self, model: Transformer, cache_types: tuple[str, str] = ("f32", "f32")) -> None:
        """Nothing to compile; say where the weights went and what they take."""
        kernels = f", {self.qlinear.kernels} kernels" if self.weights == "quantized" else ""
        log.info("torch backend: weights take %s on %s%s", self.memory.describe(), self.device, kernels)

    # ---- the step's batch -----------------------------------------------------------------------

    def begin_step(self, batch: ForwardBatch, model: Transformer) -> ForwardBatch:
        """Plan attention from the host copies (no device reads), and upload the step's index arrays
        and the plan's in one copy."""
        self._masks.clear()
        self._host = batch
        self._start_step(len(batch.input_ids), self.thread_governor(model))
        self._max_pos = int(batch.positions.max()) if len(batch.positions) else 0
        fixed = self.static_decode and static.static_eligible(batch)
        plans = [] if fixed else attention.plan(batch.query_start_loc, batch.context_lens, batch.block_tables)
        arrays = [batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices]
        dev: list[Any] = upload_ints(arrays + [a for g in plans for a in g.arrays()], self.device)  # one copy
        self._groups = attention.on_device(plans, dev[4:])
        # device tensors where ForwardBatch's types name host arrays
        return replace(batch, input_ids=dev[0], positions=dev[1], slot_mapping=dev[2], logits_indices=dev[3])

    def _plan(self, batch: ForwardBatch) -> list[attention.Group]:
        plans = attention.plan(batch.query_start_loc, batch.context_lens, batch.block_tables)
        return attention.on_device(plans, upload_ints([a for g in plans for a in g.arrays()], self.device))

    def run_layers(self, model: Transformer, x: Any, batch: ForwardBatch, kv: PagedKV) -> Any | None:
        """Decode-only steps through a fixed-shape stack (a CUDA graph on CUDA) when static_decode is on;
        else None, and the model runs its layers op by op over the paged path."""
        if not self.static_decode:
            return None
        if any(s.experts for s in model.args.layers):  # routing reads the device: no fixed-shape graph
            h = self._host  # (begin_step planned attention for the static stack; plan the paged path)
            self._groups = self._plan(h) if h else []
            return None
        return static.static_run_layers(self, model, x, kv)

    # ---- operations -----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantWeight):
            return self.qlinear(x, weight)
        return F.linear(x.to(weight.dtype), weight).float()

    def embedding(self, weight: Weight, ids: Any) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):  # a caller outside a step (tests, tools)
            ids = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)
        if isinstance(weight, QuantWeight):  # only the looked-up rows are dequantized
            return dequantize_torch(weight.rows(ids))
        return weight[ids].float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def swiglu_oai(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU, in kernels/reference.swiglu_oai's operations and order."""
        g = torch.clamp(gate.float(), max=OAI_LIMIT)
        u = torch.clamp(up.float(), min=-OAI_LIMIT, max=OAI_LIMIT)
        return g / (1.0 + torch.exp(-OAI_ALPHA * g)) * (u + 1.0)

    def geglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def attn_temperature(self, q: torch.Tensor, positions: Any, scale: float, length: int) -> torch.Tensor:
        steps = torch.floor(torch.as_tensor(positions, device=q.device).double() / length)
        return q * (torch.log(steps + 1.0) * scale + 1.0).float()[:, None, None]

    # ---- mixture of experts (kernels/moe_reference.py's computation, in torch) -----------------

    runs_moe = True

    def moe_ffn(
        self, h: torch.Tensor, lw: LayerWeights, spec: LayerSpec, router_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each routed expert on its tokens only, as kernels/moe_reference.moe_ffn; the routing waits
        for the device (the static decode stack is not used for mixture-of-experts models, see
        run_layers). The router reads router_in where given (gemma4); gpt-oss adds router_b to the
        logits and each expert's gate/up/down biases to its outputs; each expert's output is scaled by
        down_exps_s where the spec says (expert_scale)."""
        weights, ids = self._route(h if router_in is None else router_in, lw, spec)
        act_fn = {"gelu_tanh": self.geglu, "swiglu_oai": self.swiglu_oai}.get(spec.activation, self.swiglu)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for e in ids.unique().tolist():
            t, j = torch.nonzero(ids == e, as_tuple=True)
            x = h[t]
            gate, up = self.linear(x, lw.gate_exps[e]), self.linear(x, lw.up_exps[e])
            if spec.expert_bias:
                gate, up = gate + lw.gate_exps_b[e], up + lw.up_exps_b[e]
            y = self.linear(act_fn(gate, up), lw.down_exps[e])
            y = y + lw.down_exps_b[e] if spec.expert_bias else y
            y = y * lw.down_exps_s[e].float() if spec.expert_scale else y
            out.index_add_(0, t, y * weights[t, j, None])
        return out

    def _route(self, x: torch.Tensor, lw: LayerWeights, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids), each (T, experts_used): the softmax over all (biased) router logits, its k
        largest, renormalised to sum 1 where the spec says (moe_reference.route)."""
        logits = self.linear(x, lw.router).float()
        probs = torch.softmax(logits + lw.router_b if spec.router_bias else logits, dim=-1)
        weights, ids = torch.topk(probs, spec.experts_used, dim=-1)
        if spec.expert_renorm:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        return weights, ids

    def sigmoid_gate(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h.float() @ weight)[:, None]

    def to_numpy(self, x: Any) -> np.ndarray:
        out = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)
        self._end_step()  # the step's logits: it is over
        return out

    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sampled]:
        """The step's tokens drawn on the device (sampling.py): only ids and log-probabilities come back."""
        out = sample_batch(logits, rows) if rows else []
        self._end_step()
        return out

    def _end_step(self) -> None:
        if self._step is not None:
            tokens, threads, start, governor = self._step
            governor.record(tokens, threads, time.perf_counter() - start)
        self._step = None

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
        k_rows, v_rows = (c.view(nb * bs, *c.shape[2:]) for c in (k_cache, v_cache))
        k_rows[slot_mapping] = _stored(k, k_cache.dtype, kv_q8.key_rotation)
        v_rows[slot_mapping] = _stored(v, v_cache.dtype, kv_q8.value_rotation)
        return q, k

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: Any,
        context_lens: Any, block_tables: Any, scale: float, window: int = 0, softcap: float = 0.0,
        sinks: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        """Causal grouped-query attention over the paged cache, per the step's plan (begin_step); the
        index arguments are the plan's source and are not read again here. sinks: gpt-oss's per-head
        logits in each softmax's denominator (attention.attend_group)."""
        # a layer narrower than the pool's rows sees its slab as `factor` times more blocks, of which
        # pool block b is its block b * factor (engine/kv_cache.py): the plan's tables name pool blocks
        factor = k_cache.shape[0] // self._pool_blocks
        if self._static_batch is not None:
            g = attention.in_layer(attention.static_group(self._static_batch, k_cache.shape[1]), factor)
            mask = self._mask(-1, g, window)
            return attention.attend_group(q, k_cache, v_cache, g, mask, scale, softcap, sinks)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for i, g in enumerate(self._groups):
            g = attention.in_layer(g, factor)
            mask = self._mask(i, g, window)
            rows = attention.attend_group(q, k_cache, v_cache, g, mask, scale, softcap, sinks)
            out[g.tokens] = rows
        return out

    def _mask(self, i: int, g: attention.Group, window: int) -> torch.Tensor:
        """Group i's causal mask, built once per step and window (every layer reuses it)."""
        key = (i, window)
        if key not in self._masks:
            self._masks[key] = attention.causal_mask(g, window)
        return self._masks[key]


def _stored(x: torch.Tensor, dtype: torch.dtype, rotation: Callable[[int], int]) -> torch.Tensor:
    """K or V rows in a pool's element type (int8: q8_0 blocks of the rows rotated by `rotation`'s
    Hadamard size for the head width, kv_q8.py)."""
    if dtype != torch.int8:
        return x.to(dtype)
    return kv_q8.quantize_rows(kv_q8.hadamard(x, rotation(x.shape[-1])))
