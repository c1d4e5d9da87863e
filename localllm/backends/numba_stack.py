"""The Numba backend's fused layer stack: a llama-style model's layers as one kernel call per step.

`DecoderPlan` gathers what kernels/decoder.py needs once per model (launch tables of every layer's
weights, stacked norms and biases); `run` calls it with the step's batch.  Same kernels, same order
as the model's operation-by-operation path, so the same bits (tests/test_kernels.py compares).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.kernels import decoder, matmul


def _tables(groups: list[tuple[Any, ...]], use_int: bool) -> np.ndarray:
    """(layers, weights per group, 5) launch tables (see matmul.launch_many)."""
    rows = [matmul.group_table(ws, use_int) for ws in groups]
    return np.ascontiguousarray(np.stack(rows), np.int64)


def _stack(vectors: list[Any], width: int) -> np.ndarray:
    """Per-layer vectors as (layers, width) float32; missing ones (no bias) as zeros."""
    out = np.zeros((len(vectors), width), np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            out[i] = v
    return out


def can_fuse(model: Any) -> bool:
    """Only the plain pre-norm llama layer (optional q/k/v biases, no q/k norms)."""
    if not getattr(model, "fusable_layers", False):
        return False
    return all(x.attn.q_norm is None and x.attn.k_norm is None for x in model.layers)


@dataclass(eq=False)
class DecoderPlan:
    attn: tuple  # see decoder.decoder_stack
    ffn: tuple
    groups: tuple  # the weights behind the launch tables, for the float tables when first needed
    any_int: bool
    shape: tuple
    ffn_dim: int

    @classmethod
    def build(cls, model: Any) -> DecoderPlan:
        a, L = model.args, model.layers
        qkv = [(x.attn.wq, x.attn.wk, x.attn.wv) for x in L]
        o = [(x.attn.wo,) for x in L]
        gu = [(x.ffn.gate, x.ffn.up) for x in L]
        down = [(x.ffn.down,) for x in L]
        everything = [w for grp in qkv + o + gu + down for w in grp]
        any_int = any(w.lane for w in everything)
        gemm = int(everything[0].gemm) if matmul.needs_gemm(everything, True) else 0
        norms = _stack([x.attn_norm for x in L], a.dim), _stack([x.ffn_norm for x in L], a.dim)
        nq, nkv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        biases = (
            _stack([x.attn.bq for x in L], nq),
            _stack([x.attn.bk for x in L], nkv),
            _stack([x.attn.bv for x in L], nkv),
        )
        has_bias = any(x.attn.bq is not None or x.attn.bk is not None or x.attn.bv is not None for x in L)
        ints = tuple(_tables(g, True) for g in (qkv, o, gu, down))
        shape = (
            a.n_heads, a.n_kv_heads, a.head_dim, a.rope_dim, float(a.rope_base), bool(a.rope_neox),
            float(a.norm_eps), float(a.attn_scale),
        )  # fmt: skip
        attn = (ints[0], ints[1], gemm, any_int, norms[0], biases, has_bias)
        ffn = (ints[2], ints[3], gemm, any_int, norms[1])
        return cls(attn, ffn, (qkv, o, gu, down), any_int, shape, int(L[0].ffn.gate.n))

    @functools.cache  # noqa: B019 (one plan per model, kept as long as the model)
    def _float_tables(self) -> tuple[np.ndarray, ...]:
        """Float-path tables (without AVX2, long prompts): their kernels load only if needed."""
        return tuple(_tables(g, False) for g in self.groups)

    def run(self, backend: Any, x: np.ndarray, batch: Any, kv: Any) -> np.ndarray:
        """All layers on x (T, dim), in place; returns x."""
        use_int = self.any_int and x.shape[0] <= matmul.INT_PATH_MAX_T
        attn, ffn = self.attn, self.ffn
        if not use_int:
            f = self._float_tables()
            gemm = int(self.groups[0][0][0].gemm)  # the float path needs the GEMM
            attn = (f[0], f[1], gemm, False, *attn[4:])
            ffn = (f[2], f[3], gemm, False, ffn[4])
        i64 = backend.as_i64
        pos = i64(batch.positions)
        rope_table = backend._rope_table(pos, self.shape[3], self.shape[4])
        step = (
            pos, i64(batch.slot_mapping), i64(batch.query_start_loc), i64(batch.context_lens),
            i64(batch.block_tables), rope_table,
        )  # fmt: skip
        decoder.decoder_stack(x, attn, ffn, self.shape, step, (kv.k, kv.v), self.ffn_dim, backend.threads)
        return x
