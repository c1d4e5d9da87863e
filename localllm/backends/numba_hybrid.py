"""The Numba backend's fused stack for models with recurrent or gated-attention layers (qwen35,
qwen35moe, qwen3next): numba_stack.DecoderPlan's weights and steps plus kernels/hybrid_decoder.py's
tables for the Gated DeltaNet and gated attention layers, run with the engine's state pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.backends import bounds
from localllm.backends.numba_stack import DecoderPlan, StackBackend, _stack, _tables
from localllm.kernels import decoder as dk
from localllm.kernels import hybrid_decoder as hd
from localllm.kernels import matmul

if TYPE_CHECKING:
    from localllm.models.base import ForwardBatch, PagedKV
    from localllm.models.transformer import Transformer


def is_hybrid(model: Transformer) -> bool:
    return any(s.recurrent or s.attn_gate for s in model.args.layers)


def _kind(spec: Any) -> int:
    if spec.mixer == "gated_delta_net":
        return hd.KIND_GATED_DELTA
    return hd.KIND_GATED_ATTENTION if spec.attn_gate else hd.KIND_ATTENTION


def _conv_taps(model: Transformer, taps: int, channels: int) -> np.ndarray:
    out = np.zeros((len(model.layers), max(taps, 1), channels), np.float32)
    for il, lw in enumerate(model.layers):
        if lw.ssm_conv is not None:
            out[il] = lw.ssm_conv.reshape(channels, taps).T
    return out


@dataclass(eq=False)
class HybridPlan:
    base: DecoderPlan
    kinds: np.ndarray
    state_index: np.ndarray
    vectors: tuple[np.ndarray, ...]  # conv taps, dt bias, a, norm: (L, ...) each
    groups: tuple  # gated q/k/v/gate, delta-net inputs, delta-net output: per layer
    dims: hd.RecDims

    @classmethod
    def build(cls, model: Transformer) -> HybridPlan:
        a, L = model.args, model.layers
        spec = next((s for s in a.layers if s.mixer == "gated_delta_net"), None)
        n_k, n_v, d, taps = (spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_head_dim, spec.ssm_conv) if spec \
            else (1, 1, 1, 1)  # fmt: skip
        channels = (2 * n_k + n_v) * d
        if any(s.recurrent and s.state_shapes() != spec.state_shapes() for s in a.layers if spec):
            raise ValueError("recurrent layers of different shapes")
        groups = (
            [(x.wq, x.wk, x.wv, x.wg) if x.wg is not None else () for x in L],
            [(x.ssm_qkv, x.ssm_z, x.ssm_beta, x.ssm_alpha) if x.ssm_qkv is not None else () for x in L],
            [(x.ssm_out,) for x in L],
        )
        base = DecoderPlan.build(model)
        base.groups = base.groups + groups  # their kinds count in choosing the path's GEMM
        kinds = np.array([_kind(s) for s in a.layers], np.int64)
        rec = np.cumsum([s.recurrent for s in a.layers]) - 1
        index = np.where([s.recurrent for s in a.layers], rec, -1).astype(np.int64)
        vectors = (
            _conv_taps(model, taps, channels), _stack([x.ssm_dt for x in L], n_v),
            _stack([x.ssm_a for x in L], n_v), _stack([x.ssm_norm for x in L], d),
        )  # fmt: skip
        dims = hd.RecDims(n_k, n_v, d, channels, bool(spec.ssm_interleaved) if spec else False)
        return cls(base, kinds, index, vectors, groups, dims)

    def _rec(self, use_int: bool) -> hd.RecWeights:
        """The recurrent layers' tables for one path, made once and kept on the plan (a functools.cache
        would hold every plan, and its weights, after its model is unloaded)."""
        recs = self.__dict__.setdefault("_recs", {})
        if use_int not in recs:
            tables = [_tables(g, use_int) for g in self.groups]
            recs[use_int] = hd.RecWeights(self.kinds, self.state_index, *tables, *self.vectors)
        return recs[use_int]

    @property
    def moe_stats(self) -> np.ndarray:
        return self.base.moe_stats

    def run(self, backend: StackBackend, x: np.ndarray, batch: ForwardBatch, kv: PagedKV,
            per_layer: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """All layers on x (T, dim), in place; returns x (hybrid models have no per-layer inputs)."""
        if per_layer is not None:
            raise bounds.KernelBoundsError("per-layer inputs in a hybrid model")
        base, i64 = self.base, backend.as_i64
        use_int = base.any_int and x.shape[0] <= matmul.INT_PATH_MAX_T
        step = dk.Step(
            i64(batch.positions), i64(batch.slot_mapping), i64(batch.query_start_loc),
            i64(batch.context_lens), i64(batch.block_tables), base.rope_dims, base.rope_freqs,
            base.rope_mscale, np.zeros((len(base.weights.flags), 0, 0), np.float32),
        )  # fmt: skip
        rs = self._states(kv, i64, batch)
        hd.hybrid_stack(x, base._path(use_int), base.dims, step, (kv.k, kv.v), self._rec(use_int), self.dims,
                        rs, backend.threads)  # fmt: skip
        return x

    def _states(self, kv: PagedKV, i64: Any, batch: ForwardBatch) -> hd.RecStep:
        d = self.dims
        if not (self.state_index >= 0).any():
            empty = np.zeros((1, 1, 1, 1), np.float32)
            return hd.RecStep(empty, empty[..., None], i64(np.zeros(len(batch.query_start_loc) - 1)))
        conv, ssm = kv.states.arrays
        slots = i64(batch.state_slots)
        bounds.check_same(conv.shape[2:], (self.vectors[0].shape[1] - 1, d.channels), "conv state")
        bounds.check_same(ssm.shape[2:], (d.n_v, d.head_dim, d.head_dim), "ssm state")
        counts = np.diff(batch.query_start_loc)
        bounds.check_same(slots.shape, counts.shape, "state slots")
        if (counts > 0).any() and not (
            0 <= slots[counts > 0].min() and slots[counts > 0].max() < ssm.shape[1]
        ):
            raise bounds.KernelBoundsError("state_slots outside the state pool")
        return hd.RecStep(conv, ssm, slots)
