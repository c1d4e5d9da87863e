"""The Numba CPU backend: the NumpyBackend's operations, computed by the kernels in localllm.kernels.

Weights are repacked once at load (kernels/packing.py) and multiplied without ever being
dequantized as a whole.  Every kernel takes float32 C-contiguous arrays and int64/int32 index
arrays; this class normalises its inputs to exactly those types so each kernel has one compiled
specialisation, which `warmup()` compiles (or loads from Numba's cache) before the first step.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numba
import numpy as np

from localllm.backends import bounds
from localllm.backends.base import Backend
from localllm.backends.kv_types import row_width
from localllm.backends.memory import lazy_zeros
from localllm.backends.numba_hybrid import HybridPlan, is_hybrid
from localllm.backends.numba_stack import DecoderPlan, plan_for
from localllm.backends.threads import ModelGovernors, ThreadGovernor
from localllm.kernels import attention, gated_delta, layers, matmul, moe
from localllm.kernels.packing import PackedWeight, pack_weight
from localllm.quant import dequantize

if TYPE_CHECKING:
    from localllm.backends.weight_cache import WeightCache
    from localllm.loading.file import GGUFFile
    from localllm.models.base import ForwardBatch, PagedKV
    from localllm.models.layers import LayerWeights
    from localllm.models.spec import LayerSpec, RopeSpec
    from localllm.models.transformer import Transformer

_KV_STORAGE = {"f32": np.float32, "f16": np.uint16, "q8_0": np.int8}  # q8_0: ggml's block bytes

# Attention below this many multiply-adds runs on one thread (a parallel launch costs ~5 us).
_ATTN_PARALLEL_MIN = 1 << 15
# Warm-up steps timed per thread count before the first request (NumbaBackend._calibrate_threads).
CALIBRATION_ROUNDS, CALIBRATION_SECONDS = 2, 1.0  # (no further round once this long was spent)


# Kernels are compiled for C-contiguous, writable arrays of one dtype; a read-only or strided
# input would compile another specialisation mid-run.  These convert only when needed.
# (np.require costs ~5 us a call, and a decode step makes hundreds of these checks.)
def _f32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable:
        return x
    return np.require(x, np.float32, ["C", "W"])


def _rows(x: np.ndarray, k: int) -> np.ndarray:
    """x (..., k) as float32 rows (T, k); a last axis that is not k is refused, never re-cut."""
    if x.shape[-1] != k:
        raise ValueError(f"activations of width {x.shape[-1]} do not fit a weight of {k} columns")
    return _f32(x).reshape(-1, k)


def _i64(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.int64 and x.flags.c_contiguous and x.flags.writeable:
        return x
    return np.require(x, np.int64, ["C", "W"])


class NumbaBackend(Backend):
    name = "numba"

    def __init__(self, threads: int, adaptive_threads: bool = True):
        """threads: the most threads the kernels use (clamped to 1..NUMBA_NUM_THREADS); with
        adaptive_threads each step size runs with whichever of that or 1 thread is measured faster
        (see threads.py: a busy machine makes parallel launches wait)."""
        self.threads = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(self.threads)
        self._governors = ModelGovernors(self.threads, adaptive_threads)
        self._prepared: dict[tuple, PackedWeight] = {}
        self._raws: list[np.ndarray] = []  # the arrays _prepared's keys name
        self._groups: dict[tuple[int, ...], matmul.WeightGroup] = {}
        self._rope_tables: dict[RopeSpec, tuple[np.ndarray, ...]] = {}
        self._plans: dict[
            int, tuple[object, DecoderPlan | None]
        ] = {}  # id(model) -> (model, DecoderPlan or None)
        self.fuse_layers = True  # tests turn it off to compare with the op-by-op path
        self.team_stack = True  # dense layers' stack on one team of threads (off: a launch per projection)
        self.moe_stats = np.zeros(2, np.int64)  # op path's expert bytes launched, rows (kernels/moe.py)
        self._conv_taps: dict[int, tuple[np.ndarray, object]] = {}  # id(conv weights) -> (taps, C), owner

    # ---- weights and cache -------------------------------------------------------------------

    def prepare_weight(
        self, raw: np.ndarray, ggml_type: int, cache: WeightCache | None = None
    ) -> PackedWeight:
        """Repack a matrix once (the same tensor asked twice, e.g. tied embeddings, is packed once),
        from the disk cache `cache` when it holds it."""
        key = (raw.__array_interface__["data"][0], raw.shape, raw.dtype.str, int(ggml_type))
        packed = self._prepared.get(key)
        if packed is None:
            pack = cache.pack if cache is not None else pack_weight
            packed = self._prepared[key] = matmul.prepare_weight(raw, ggml_type, pack)
            # kept alive (a view of the file, or rows gathered from a tensor): no later array reuses its key
            self._raws.append(raw)
        return packed

    def prepare_rows(
        self, raw: np.ndarray, rows: np.ndarray, ggml_type: int, cache: WeightCache | None = None
    ) -> PackedWeight:
        """prepare_weight(raw[rows]), with no gather (nor a read of those pages) where `cache` holds it."""
        if cache is None:
            return super().prepare_rows(raw, rows, ggml_type, cache)
        key = (raw.__array_interface__["data"][0], raw.shape, rows.tobytes(), int(ggml_type))
        packed = self._prepared.get(key)
        if packed is None:

            def pack(_: np.ndarray, t: int) -> PackedWeight:
                return cache.pack_rows(raw, rows, t)

            packed = self._prepared[key] = matmul.prepare_weight(raw, ggml_type, pack)
            self._raws.append(raw)
        return packed

    def open_weight_cache(self, gf: GGUFFile, cache_dir: Path) -> WeightCache:
        """The disk cache of gf's packed weights in cache_dir (the caller saves it after the load: never
        a cache of a half-loaded model)."""
        from localllm.backends.weight_cache import WeightCache

        return WeightCache(gf, cache_dir)

    def numerics(self) -> str:
        """Numba's version, the kernels' sources, the CPU they are compiled for, and the path a step takes
        (the fused stack or op by op): any of them may change the last bits of the K/V computed."""
        import llvmlite.binding as llvm

        from localllm.kernels.cache import sources_digest

        cpu = numba.config.CPU_NAME or llvm.get_host_cpu_name()
        features = numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
        digest = hashlib.sha256(f"{cpu}|{features}".encode()).hexdigest()[:12]
        return f"numba {numba.__version__}|kernels {sources_digest()}|cpu {digest}|fused {self.fuse_layers}"

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> np.ndarray:
        return _f32(dequantize(raw, ggml_type)).reshape(-1)  # a copy: F32 file data is read-only

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """f16 is stored as IEEE half bits in uint16 (Numba has no float16 arrays), q8_0 as its blocks'
        bytes in int8 (kernels/kv.py)."""
        shape = (n_layers, num_blocks, block_size, kv_heads)
        # resident as blocks are written
        k, v = (lazy_zeros((*shape, row_width(t, head_dim)), _KV_STORAGE[t]) for t in cache_types)
        return k, v

    as_i64 = staticmethod(_i64)

    def run_layers(
        self, model: Transformer, x: np.ndarray, batch: ForwardBatch, kv: PagedKV
    ) -> np.ndarray | None:
        """All of `model`'s layers on x in one kernel call (see kernels/decoder.py); None when fusion is
        off (tests compare both paths) or the stack cannot execute the model's specs (logged once)."""
        plan = self._plan(model) if self.fuse_layers else None
        if plan is None:
            return None
        start = time.perf_counter()
        out = self._run_plan(plan, model, x, batch, kv)
        self.thread_governor(model).record(x.shape[0], self.threads, time.perf_counter() - start)
        return out

    def _run_plan(
        self, plan: DecoderPlan, model: Transformer, x: np.ndarray, batch: ForwardBatch, kv: PagedKV
    ) -> np.ndarray:
        bounds.check_step(model.args, x, batch, kv.k, kv.v)
        per_layer = model.per_layer_inputs(batch.input_ids, x) if model.args.per_layer_dim else None
        return plan.run(self, _f32(x), batch, kv, per_layer)

    def _plan(self, model: Transformer) -> DecoderPlan | None:
        """The model's fused-stack plan, built once (None: the stack cannot run its specs)."""
        entry = self._plans.get(id(model))
        if entry is None:
            build = HybridPlan.build if is_hybrid(model) else None
            entry = self._plans[id(model)] = (model, plan_for(model, build))  # keeps the id's model alive
        return entry[1]

    def fused(self, model: Transformer) -> bool:
        """Whether steps of `model` run as one fused call."""
        return self.fuse_layers and self._plan(model) is not None

    def thread_governor(self, model: Transformer) -> ThreadGovernor:
        return self._governors.of(model)

    def begin_step(self, batch: ForwardBatch, model: Transformer) -> ForwardBatch:
        """Pick this step's thread count (see threads.py)."""
        n = self.thread_governor(model).choose(int(batch.input_ids.shape[0]))
        # Numba's count is per calling thread, and a new thread starts at all cores: an engine stepped
        # from another thread (the server's) must be told too, not only when the choice changes.
        if n != self.threads or numba.get_num_threads() != n:
            self.threads = n
            numba.set_num_threads(n)
        return batch

    # ---- operations ----------------------------------------------------------------------------

    def linear(self, x: np.ndarray, weight: PackedWeight) -> np.ndarray:
        """x (T, K) or (K,) times the (N, K) weight transposed -> (T, N) or (N,)."""
        x2 = _rows(x, weight.k)
        y = matmul.linear(x2, weight, self.threads)
        return y if x.ndim == 2 else y.reshape(*x.shape[:-1], weight.n)

    def linear_precise(self, x: np.ndarray, weight: PackedWeight) -> np.ndarray:
        """linear, nearly as if the activations stayed float32, for the projections where rounding them
        to 8 bits shows: the output projection (SmolLM2's logits: RMS 0.32 -> 0.27 against llama.cpp)
        and Gemma's down projection (its GeGLU outputs have large outliers: 1.17 -> 0.78 on a long
        prompt). Q8_0 weights take 16-bit activations in one pass; other kinds send the rounding
        residual through a second 8-bit pass (its own error is 1/127 as large) in the same launch.
        Far cheaper than the float path's dequantization, and the same path at every batch size,
        so a row's result never depends on its batch."""
        x2 = _rows(x, weight.k)
        y = matmul.linear_precise(x2, weight, self.threads)  # one compiled call: ~50 us of Python before
        if y is None:  # the float path multiplies float activations already
            return matmul.linear(x2, weight, self.threads)
        return y

    def linear_many(self, x: np.ndarray, weights: Sequence[PackedWeight]) -> list[np.ndarray]:
        """[linear(x, w) for w in weights] (same values) in one kernel launch: for weights that
        share their input, like q/k/v or gate/up.  Saves a launch and a quantization of x per
        extra weight and splits the combined rows evenly over the threads.  The results are
        column views of one (T, sum of N) array."""
        key = tuple(map(id, weights))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = matmul.WeightGroup.of(tuple(weights))  # keeps the ids alive
        return matmul.linear_group(_rows(x, weights[0].k), group, self.threads)

    def embedding(self, weight: PackedWeight, ids: np.ndarray) -> np.ndarray:
        return matmul.embedding(weight, _i64(ids).reshape(-1))

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x2 = _f32(x).reshape(-1, x.shape[-1])
        bounds.check_same(weight.shape, (x2.shape[1],), "rms_norm weight")
        out = np.empty_like(x2)
        layers.rms_norm_rows(x2, _f32(weight), float(eps), out)
        return out.reshape(x.shape)

    def rope_store_kv(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, rope: RopeSpec,
        k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(rope(q), rope(k)), with the rotated k and v stored in the cache."""
        q3, k3, v3, pos, slots = _f32(q), _f32(k), _f32(v), _i64(positions), _i64(slot_mapping)
        bounds.check_kv_write((k3.shape, v3.shape), (k_cache, v_cache), slots, pos)
        q_out, k_out = np.empty_like(q3), np.empty_like(k3)
        tab_pos, cos, sin, freqs = self._rope_table(pos, rope)
        layers.rope_rows(pos, freqs, float(rope.mscale()), tab_pos, cos, sin)
        layers.rope_store_kv(
            q3, k3, v3, cos, sin, int(rope.dim), bool(rope.neox), k_cache, v_cache, slots, q_out, k_out
        )
        return q_out, k_out

    def _rope_table(self, positions: np.ndarray, rope: RopeSpec) -> tuple[np.ndarray, ...]:
        """(positions, cos, sin) rows for one rotation, grown to hold len(positions) rows, and its
        per-pair speeds.  rope_rows recomputes a row only when its position changed, so the layers of
        a step share it."""
        table = self._rope_tables.get(rope)
        n = positions.shape[0]
        if table is None or table[0].shape[0] < n:
            rows = max(n, 2 * table[0].shape[0] if table is not None else 16)
            half = int(rope.dim) // 2
            table = (
                np.full(rows, -1, np.int64),
                np.empty((rows, half), np.float32),
                np.empty((rows, half), np.float32),
                np.ascontiguousarray(rope.frequencies(), np.float64),
            )
            self._rope_tables[rope] = table
        return table

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._gated(layers.swiglu_rows, gate, up)

    def geglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._gated(layers.geglu_rows, gate, up)

    def swiglu_oai(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._gated(layers.swiglu_oai_rows, gate, up)

    @staticmethod
    def _gated(kernel, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        bounds.check_same(gate.shape, up.shape, "gate and up")
        g, u = _f32(gate).reshape(-1, gate.shape[-1]), _f32(up).reshape(-1, up.shape[-1])
        out = np.empty_like(g)
        kernel(g, u, out)
        return out.reshape(gate.shape)

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return np.float32(cap) * np.tanh(x / np.float32(cap))

    def paged_attention(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        query_start_loc: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: np.ndarray | None = None,
    ) -> np.ndarray:
        q3 = _f32(q)
        qsl, ctx, tables = _i64(query_start_loc), _i64(context_lens), _i64(block_tables)
        bounds.check_attention(q3.shape, (k_cache, v_cache), qsl, ctx, tables)
        out = np.empty_like(q3)
        s = np.empty(0, np.float32) if sinks is None else _f32(sinks).reshape(-1)
        if s.size not in (0, q3.shape[1]):
            raise ValueError(f"paged_attention: {s.size} sinks for {q3.shape[1]} heads")
        args = (q3, k_cache, v_cache, qsl, ctx, tables, float(scale), int(window), float(softcap), s, out)
        work = q3.shape[0] * q3.shape[1] * q3.shape[2] * (int(ctx.max()) if ctx.size else 0)
        if self.threads > 1 and work >= _ATTN_PARALLEL_MIN:
            attention.paged_attention_sinks_par(*args, self.threads)
        else:
            attention.paged_attention_sinks_serial(*args)
        return out

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    # ---- mixture of experts --------------------------------------------------------------------

    runs_moe = True

    def moe_ffn(
        self, h: np.ndarray, lw: LayerWeights, spec: LayerSpec, router_in: np.ndarray | None = None
    ) -> np.ndarray:
        """Only the routed experts' matrices are read (kernels/moe.py); tokens grouped by expert."""
        h2 = _rows(h, lw.router.k)
        hr = h2 if router_in is None else _rows(router_in, lw.router.k)
        everything = (lw.router, *lw.gate_exps, *lw.up_exps, *lw.down_exps)
        use_int = any(w.lane for w in everything) and h2.shape[0] <= matmul.INT_PATH_MAX_T
        gemm = lw.router.gemm if matmul.needs_gemm(everything, use_int) else 0
        groups = ((lw.router,), lw.gate_exps, lw.up_exps, lw.down_exps)
        tables = [matmul.group_table(ws, use_int) for ws in groups]
        out = np.empty_like(h2)
        no1, no2 = np.empty(0, np.float32), np.empty((0, 0), np.float32)
        rb = _f32(lw.router_b).reshape(-1) if spec.router_bias else no1
        expert_b = (lw.gate_exps_b, lw.up_exps_b, lw.down_exps_b)
        gb, ub, db = (_f32(b) if spec.expert_bias else no2 for b in expert_b)
        ds = _f32(lw.down_exps_s).reshape(-1) if spec.expert_scale else no1
        act = {"swiglu_oai": moe.ACT_OAI, "gelu_tanh": moe.ACT_GELU}.get(spec.activation, moe.ACT_SILU)
        moe.moe_ffn_ext(h2, hr, *tables, gemm, use_int, spec.experts_used, spec.expert_renorm, act, rb, gb,
                        ub, db, ds, out, self.moe_stats, self.threads)  # fmt: skip
        return out

    def sigmoid_gate(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        h2 = _rows(h, weight.shape[0])
        out = np.empty((h2.shape[0], 1), np.float32)
        moe.sigmoid_gate(h2, _f32(weight), out.reshape(-1))
        return out

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return _f32(x) / (np.float32(1.0) + np.exp(-_f32(gate)))

    # ---- recurrent mixers ----------------------------------------------------------------------

    runs_gated_delta = True

    def gated_delta(self, qkv, z, beta, alpha, lw, spec, batch, conv_state, ssm_state, eps):
        """kernels/gated_delta.mixer_core; the conv taps transposed to (taps, channels) once."""
        qkv2, z2 = _f32(qkv), _f32(z)
        bounds.check_gated_delta(qkv2.shape, spec, batch, conv_state.shape, ssm_state.shape)
        taps = self._conv_taps.get(id(lw.ssm_conv))
        if taps is None:
            taps = self._conv_taps[id(lw.ssm_conv)] = (
                np.ascontiguousarray(lw.ssm_conv.reshape(-1, spec.ssm_conv).T),
                lw,
            )
        out = np.empty(z2.shape, np.float32)
        gated_delta.mixer_core(
            qkv2, z2, _f32(beta), _f32(alpha), taps[0], lw.ssm_dt, lw.ssm_a, lw.ssm_norm,
            _i64(batch.query_start_loc), _i64(batch.positions), _i64(batch.state_slots), conv_state,
            ssm_state,
            spec.ssm_k_heads, spec.ssm_head_dim, spec.ssm_interleaved, float(eps), np.empty_like(qkv2), out,
            self.threads,
        )  # fmt: skip
        return out

    # ---- compilation -------------------------------------------------------------------------

    def warmup(self, model: Transformer | None = None, cache_types: tuple[str, str] = ("f32", "f32")) -> None:
        """Compile (or load from Numba's cache) every kernel specialisation a model step uses, on
        tiny inputs, so no compilation ever happens inside a decode loop.  The per-type matmul
        kernels were already compiled by `prepare_weight`; this covers the launchers and layers
        (not the op-by-op layer kernels when `model` will run as a fused stack, see decoder_stack)."""
        from localllm.kernels.warmup import warm_kernels

        fused = model is not None and self.fused(model)
        kv_dtypes = (_KV_STORAGE[cache_types[0]], _KV_STORAGE[cache_types[1]])
        warm_kernels(list(self._prepared.values()), self.threads, not fused, kv_dtypes)
        if fused and model is not None:
            self._warm_stack(model, cache_types)

    def _warm_stack(self, model: Transformer, cache_types: tuple[str, str]) -> None:
        """One token through the fused stack, on a private one-block KV cache: loads it from
        Numba's cache (needed by the first step anyway), or on a machine's first run compiles it
        here instead of inside the first request (~40 s there)."""
        from localllm.models.base import ForwardBatch

        a = model.args
        k, v = self.allocate_kv(a.n_layers, 1, 16, *a.kv_row_shape(), cache_types)
        one = np.zeros(1, np.int64)
        batch = ForwardBatch(
            one, one, one - 1, np.array([0, 1]), one + 1, np.zeros((1, 1), np.int64), one, one
        )
        x = np.zeros((1, a.dim), np.float32)
        plan, kv = self._plan(model), SimpleNamespace(k=k, v=v, states=_one_state(a))
        assert plan is not None  # (fused)
        self._run_plan(plan, model, x, batch, kv)  # loads or compiles: not a step's time
        self._calibrate_threads(model, lambda: self._run_plan(plan, model, x, batch, kv))

    def _calibrate_threads(self, model: Transformer, step: Callable[[], object]) -> None:
        """Give the thread governor a measured choice for one-token steps before the first request:
        the warm-up step timed with each candidate count (alternating, the best of CALIBRATION_ROUNDS).
        Steps of up to 16 tokens start from that choice; without it a fresh process's first such step
        (a prompt restored from the prefix cache's disk tier) timed both counts, on a loaded machine
        paying ~2x for the 2-thread try (docs/benchmarks.md, restart TTFT)."""
        governor, threads = self.thread_governor(model), self.threads
        best: dict[int, float] = {}
        if len(governor.candidates) < 2:
            return
        began = time.perf_counter()
        try:
            for _ in range(CALIBRATION_ROUNDS):
                for n in governor.candidates:
                    self.threads = n  # (the kernels' partition count; Numba's for its parallel loops)
                    numba.set_num_threads(n)
                    start = time.perf_counter()
                    step()
                    best[n] = min(best.get(n, np.inf), time.perf_counter() - start)
                if time.perf_counter() - began > CALIBRATION_SECONDS:  # a large model: one round will do
                    break
        finally:
            self.threads = threads
            numba.set_num_threads(threads)
        for n, seconds in best.items():
            governor.record(1, n, seconds)


def _one_state(args: object) -> SimpleNamespace | None:
    """A one-slot recurrent state pool (the engine's StateCache's arrays) for a warm-up step."""
    recurrent = [s for s in args.layers if s.recurrent]  # type: ignore[attr-defined]
    if not recurrent:
        return None
    shapes = recurrent[0].state_shapes()
    return SimpleNamespace(
        arrays=tuple(np.zeros((len(recurrent), 1, *shape), np.float32) for _, shape in shapes)
    )
