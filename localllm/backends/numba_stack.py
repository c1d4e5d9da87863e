"""The Numba backend's fused layer stack: a model's layers, as their LayerSpecs say, in one kernel call.

`DecoderPlan.build` turns a model's specs and weights into kernels/decoder.py's named inputs once per
model; `run` calls it with the step's batch. Every LayerSpec field must be listed in `EXECUTED`:
a field the stack does not execute, set to anything but its default, makes `refusal` name it, the
backend log it and the model run op by op (a test fails when a new field is not listed).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from localllm.kernels import decoder as dk
from localllm.kernels import matmul, team_stack
from localllm.models.spec import LayerSpec, ModelArgs, RopeSpec, spec_fields

if TYPE_CHECKING:
    from localllm.models.base import ForwardBatch, PagedKV
    from localllm.models.transformer import Transformer

log = logging.getLogger("localllm")

# LayerSpec fields kernels/decoder.py executes (rope.* are the RopeSpec's fields).
# The plan executes every rope.* field through RopeSpec.frequencies() and mscale().
EXECUTED = frozenset(
    {"rope.dim", "rope.base", "rope.freq_scale", "rope.neox", "rope.factors", "rope.attn_factor",
     "rope.yarn_orig_ctx", "rope.yarn_beta_fast", "rope.yarn_beta_slow", "window", "qkv_bias", "qk_norm",
     "post_attn_norm", "post_ffn_norm", "activation", "precise_down", "attn_softcap", "experts",
     "experts_used", "expert_ffn_dim", "expert_renorm", "shared_expert", "attn_sinks", "o_bias",
     "router_bias", "expert_bias", "parallel_experts", "expert_scale"}
    | {"rope.yarn_log_mul", "attn_temp_scale", "attn_temp_length", "v_from_k", "v_norm", "out_scale"}
    | {"head_dim", "kv_heads", "ffn_dim", "kv_source"}
    # run by numba_hybrid.HybridPlan (kernels/hybrid_decoder.py), which plan_for picks for them
    | {"mixer", "attn_gate", "ssm_conv", "ssm_k_heads", "ssm_v_heads", "ssm_head_dim", "ssm_interleaved"}
)  # fmt: skip


def refusal(specs: tuple[LayerSpec, ...]) -> str | None:
    """Why the fused stack cannot run these layers (the first unexecuted field set), else None."""
    defaults = spec_fields(LayerSpec(RopeSpec(dim=0)))
    for il, spec in enumerate(specs):
        for name, value in spec_fields(spec).items():
            if name not in EXECUTED and value != defaults.get(name):
                return f"layer {il}: LayerSpec.{name} = {value!r} is not executed by the fused stack"
    return None


def _tables(groups: list[tuple[Any, ...]], use_int: bool) -> np.ndarray:
    """(layers, weights per group, matmul.TABLE_LEN) launch tables (see matmul.launch_many); zero rows
    where a layer has no such weights (a mixture-of-experts layer's dense FFN, a dense layer's experts)."""
    width = max(1, max(len(ws) for ws in groups))
    out = np.zeros((len(groups), width, matmul.TABLE_LEN), np.int64)
    for il, ws in enumerate(groups):
        if ws and ws[0] is not None:
            out[il, : len(ws)] = matmul.group_table(ws, use_int)
    return out


def _precise_down(down: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """The down tables with Q8_1's float16 sums made exact Q8_0 ones in two-pass layers (the residual
    pass cannot see their rounding: matmul.precise_rounding)."""
    two_pass = flags[:, dk.F_DOWN] == dk.DOWN_TWO_PASS
    down[two_pass, :, matmul.T_ROUND] = matmul.precise_rounding(down[two_pass, :, matmul.T_ROUND])
    return down


def _stack(vectors: list[Any], width: int) -> np.ndarray:
    """Per-layer vectors as (layers, width) float32, zero-padded (a layer's may be narrower)."""
    out = np.zeros((len(vectors), width), np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            out[i, : len(v)] = v
    return out


def _down_mode(spec: LayerSpec, down: Any) -> int:
    # (a row kind takes the float path: precise already; a layer with experts only has no down)
    if not spec.precise_down or down is None or not down.lane:
        return dk.DOWN_PLAIN
    return dk.DOWN_INT16 if down.kind == matmul.Q8_0 else dk.DOWN_TWO_PASS


def _flags(a: ModelArgs, layers: list[Any], ropes: list[RopeSpec]) -> np.ndarray:
    specs = a.layers
    flags = np.zeros((len(specs), dk.N_FLAGS), np.int64)
    for il, (s, lw) in enumerate(zip(specs, layers, strict=True)):
        flags[il, dk.F_HEAD_DIM], flags[il, dk.F_KV_HEADS] = a.head_dim_of(il), a.kv_heads_of(il)
        flags[il, dk.F_FFN], flags[il, dk.F_PER_LAYER] = a.ffn_dim_of(il), a.per_layer_dim > 0
        flags[il, dk.F_KV_LAYER] = il if s.kv_source < 0 else s.kv_source
        flags[il, dk.F_KV_FACTOR] = a.kv_block_factor(il)
        flags[il, dk.F_WINDOW] = s.window
        flags[il, dk.F_GELU] = s.activation == "gelu_tanh"
        flags[il, dk.F_BIAS], flags[il, dk.F_QK_NORM] = s.qkv_bias, s.qk_norm
        flags[il, dk.F_POST_ATTN], flags[il, dk.F_POST_FFN] = s.post_attn_norm, s.post_ffn_norm
        flags[il, dk.F_DOWN] = _down_mode(s, lw.down)
        flags[il, dk.F_ROPE] = ropes.index(s.rope)
        flags[il, dk.F_EXPERTS], flags[il, dk.F_RENORM] = s.experts_used, s.expert_renorm
        flags[il, dk.F_SHARED] = s.shared_expert
        flags[il, dk.F_SINKS], flags[il, dk.F_O_BIAS] = s.attn_sinks, s.o_bias
        flags[il, dk.F_EXPERT_BIAS] = s.router_bias or s.expert_bias
        flags[il, dk.F_OAI] = s.activation == "swiglu_oai"
        flags[il, dk.F_V_NORM] = s.v_norm
        flags[il, dk.F_PARALLEL], flags[il, dk.F_EXPERT_SCALE] = s.parallel_experts, s.expert_scale
    return flags


def _stack_any(arrays: list[Any], ndim: int) -> np.ndarray:
    """Per-layer arrays of one shape as (layers, *shape) float32, zeros where a layer has none; a
    0-wide array (of ndim + 1 dimensions, as the kernels are typed) where no layer has one."""
    shape = next((np.shape(a) for a in arrays if a is not None), (0,) * ndim)
    out = np.zeros((len(arrays), *shape), np.float32)
    for i, a in enumerate(arrays):
        if a is not None:
            out[i] = a
    return out


def _extras(specs: tuple[LayerSpec, ...], layers: list[Any]) -> dk.Extras:
    """The rarer per-layer arrays (a 0-wide one, which the kernels skip, where no layer has it); a
    layer whose spec leaves one off gets zeros (F_EXPERT_BIAS covers router and expert biases)."""
    on = {"sinks": ("attn_sinks", 1), "bo": ("o_bias", 1), "router_b": ("router_bias", 1)}
    on |= {f: ("expert_bias", 2) for f in ("gate_exps_b", "up_exps_b", "down_exps_b")}
    on |= {
        f: ("parallel_experts", 1)
        for f in ("ffn_norm_2", "post_ffn_norm_1", "post_ffn_norm_2", "router_norm")
    }
    on |= {"down_exps_s": ("expert_scale", 1)}
    pairs = list(zip(specs, layers, strict=True))
    return dk.Extras(*(_stack_any([getattr(x, f) if getattr(s, flag) else None for s, x in pairs], ndim)
                       for f, (flag, ndim) in on.items()))  # fmt: skip


def _int16_tables(layers: list[Any], flags: np.ndarray) -> np.ndarray:
    out = np.zeros((len(layers), 5), np.int64)
    for il, lw in enumerate(layers):
        if flags[il, dk.F_DOWN] == dk.DOWN_INT16:
            d = lw.down
            out[il] = (matmul.range_kernel(matmul.Q8_0, "int16").address, d.addr, d.nbytes, d.n, d.k)
    return out


def _rope_rows(ropes: list[RopeSpec]) -> tuple[np.ndarray, np.ndarray]:
    """Each rotation's per-pair speeds, zero-padded to the widest, and its cos/sin magnitude."""
    freqs = np.zeros((len(ropes), max(1, max(r.dim // 2 for r in ropes))), np.float64)
    for i, r in enumerate(ropes):
        freqs[i, : r.dim // 2] = r.frequencies()
    return freqs, np.array([r.mscale() for r in ropes], np.float64)


@dataclass(eq=False)
class DecoderPlan:
    weights: dk.StackWeights  # with the integer-path tables
    dims: dk.Dims
    groups: tuple  # the weights behind the launch tables, for the float tables when first needed
    rope_dims: np.ndarray  # (R, 2) int64 for the distinct rotations, which flags[:, F_ROPE] indexes
    rope_freqs: np.ndarray  # (R, max half) float64 per-pair speeds
    rope_mscale: np.ndarray  # (R,) float64

    @classmethod
    def build(cls, model: Transformer) -> DecoderPlan:
        a, L = model.args, model.layers
        ropes = list(dict.fromkeys(s.rope for s in a.layers))
        flags = _flags(a, L, ropes)
        groups = (
            [(x.wq, x.wk, x.wv) if x.wk is not None else (x.wq,) for x in L], [(x.wo,) for x in L],
            [(x.gate, x.up) for x in L], [(x.down,) for x in L], [(x.router,) for x in L],
            [x.gate_exps for x in L], [x.up_exps for x in L], [x.down_exps for x in L],
            [(x.ple_gate,) for x in L], [(x.ple_proj,) for x in L],
        )  # fmt: skip
        n = range(a.n_layers)  # buffers at the largest layer's sizes
        hd, kvh, ffn = (max(f(il) for il in n) for f in (a.head_dim_of, a.kv_heads_of, a.ffn_dim_of))
        nq, nkv = a.n_heads * hd, kvh * hd
        weights = dk.StackWeights(
            *(_tables(g, True) for g in groups[:3]), _precise_down(_tables(groups[3], True), flags),
            _int16_tables(L, flags),
            *(_stack([getattr(x, f) for x in L], a.dim)
              for f in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm")),
            _stack([x.q_norm for x in L], hd), _stack([x.k_norm for x in L], hd),
            _stack([x.bq for x in L], nq), _stack([x.bk for x in L], nkv), _stack([x.bv for x in L], nkv),
            flags, np.array([s.attn_softcap for s in a.layers], np.float32), 0, True,
            *(_tables(g, True) for g in groups[4:8]), _stack([x.shexp_gate for x in L], a.dim),
            np.zeros(2, np.int64),
            np.array([(s.attn_temp_scale, s.attn_temp_length) for s in a.layers], np.float64),
            _stack([x.v_norm for x in L], hd), np.array([s.out_scale for s in a.layers], np.float32),
            _extras(a.layers, L), *(_tables(g, True) for g in groups[8:]),
            _stack([x.ple_norm for x in L], a.dim),
        )  # fmt: skip
        two_pass = bool((flags[:, dk.F_DOWN] == dk.DOWN_TWO_PASS).any())
        dims = dk.Dims(a.n_heads, kvh, hd, ffn, float(a.norm_eps), float(a.attn_scale), two_pass)
        rope_dims = np.array([(r.dim, r.neox) for r in ropes], np.int64)
        return cls(weights, dims, groups, rope_dims, *_rope_rows(ropes))

    @functools.cached_property
    def everything(self) -> list[Any]:
        return [w for grp in self.groups for ws in grp for w in ws if w is not None]

    @functools.cached_property
    def any_int(self) -> bool:
        return any(w.lane for w in self.everything)

    @property
    def moe_stats(self) -> np.ndarray:
        """(expert-weight bytes launched, (token, layer) rows routed) since the plan was built."""
        return self.weights.moe_stats

    def _path(self, use_int: bool) -> dk.StackWeights:
        """The weights with one path's tables: integer, or float (without AVX2 for long prompts,
        whose kernels load only when needed), made once per plan. Kept on the plan, not in a
        functools.cache, which would hold every plan (and its weights) after its model is unloaded."""
        paths = self.__dict__.setdefault("_paths", {})
        if use_int not in paths:
            paths[use_int] = self._make_path(use_int)
        return paths[use_int]

    def _make_path(self, use_int: bool) -> dk.StackWeights:
        everything = self.everything
        gemm = int(everything[0].gemm) if matmul.needs_gemm(everything, use_int) else 0
        if use_int:
            return self.weights._replace(gemm=gemm, quantize=True)
        f = [_tables(g, False) for g in self.groups]
        return self.weights._replace(qkv=f[0], o=f[1], gate_up=f[2], down=f[3], router=f[4], gate_exps=f[5],
                                     up_exps=f[6], down_exps=f[7], ple_gate=f[8], ple_proj=f[9], gemm=gemm,
                                     quantize=False)  # fmt: skip

    def run(self, backend: StackBackend, x: np.ndarray, batch: ForwardBatch, kv: PagedKV,
            per_layer: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """All layers on x (T, dim), in place; returns x. per_layer: (T, layers, P) per-layer inputs
        (Transformer.per_layer_inputs) where the model has them."""
        use_int = self.any_int and x.shape[0] <= matmul.INT_PATH_MAX_T
        i64 = backend.as_i64
        inputs = np.zeros((len(self.weights.flags), 0, 0), np.float32) if per_layer is None else \
            np.ascontiguousarray(np.asarray(per_layer, np.float32).transpose(1, 0, 2))  # fmt: skip
        step = dk.Step(
            i64(batch.positions), i64(batch.slot_mapping), i64(batch.query_start_loc),
            i64(batch.context_lens), i64(batch.block_tables), self.rope_dims, self.rope_freqs,
            self.rope_mscale, inputs,
        )  # fmt: skip
        run = team_stack.team_stack if self.team and backend.team_stack else dk.decoder_stack
        run(x, self._path(use_int), self.dims, step, (kv.k, kv.v), backend.threads)
        return x

    @functools.cached_property
    def team(self) -> bool:
        """Whether kernels/team_stack.py runs these layers (dense ones), else decoder_stack."""
        return team_stack.supports(self.weights.flags)


class StackBackend(Protocol):
    """What the stack uses of the Numba backend (typed here: importing it would be an import cycle)."""

    threads: int
    team_stack: bool  # run dense layers with kernels/team_stack.py (tests turn it off to compare)

    def as_i64(self, a: np.ndarray) -> np.ndarray: ...


def plan_for(model: Transformer, build: Any = None) -> Any:
    """The model's plan, or None (logged once, naming the field) when the stack cannot run its specs;
    `build` makes it (DecoderPlan.build by default; numba_hybrid.HybridPlan.build for hybrids)."""
    reason = refusal(model.args.layers)
    if reason is not None:
        log.warning("running %s layer by layer: %s", model.args.architecture, reason)
        return None
    return (build or DecoderPlan.build)(model)
