"""The backend seam: the operations a model's forward pass calls, and the optional capabilities.

The shared decoder (localllm/models) calls only the operations below, so the same architecture runs on
the NumPy reference, the Numba CPU kernels, or a device backend. Capabilities a backend may add are
declared here with their do-nothing defaults, so callers never probe with getattr/hasattr:
`run_layers` (a fused layer stack), `sample` (a step's tokens drawn where the logits are),
`begin_step` (upload a step's batch to the device, pick its thread count), `thread_governor` (the
thread count learned per model from step times), `warmup` (compile before the first request) and
`open_weight_cache` (a disk cache of prepared weights, which the loader passes back to
`prepare_weight`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from localllm.backends.threads import ThreadGovernor
    from localllm.loading.file import GGUFFile
    from localllm.models.batch import ForwardBatch, PagedKV
    from localllm.models.spec import LayerSpec, RopeSpec
    from localllm.sampling_params import SamplingParams

# The model and a layer's weights, as the backend sees them. Not imported from models.transformer and
# models.layers: those name the Backend, and type-only imports count as import cycles here.
Transformer = Any
LayerWeights = Any


@dataclass(slots=True)
class SampleRow:
    """One logits row to sample: its parameters, its sequence's history (for penalties), the generator
    the host sampler would draw from, and the tokens a grammar allows (bool (vocab,); None: all)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    rng: np.random.Generator
    allowed: np.ndarray | None = None


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Backend:
    name = "abstract"

    # ---- weights and memory ---------------------------------------------------------------------

    def prepare_weight(self, raw: np.ndarray, ggml_type: int, cache: Any = None) -> Any:
        """A matrix as stored in the GGUF (possibly repacked once), for `linear`/`embedding`; `cache`
        is what open_weight_cache gave for the file `raw` comes from, or None."""
        raise NotImplementedError

    def prepare_rows(self, raw: np.ndarray, rows: np.ndarray, ggml_type: int, cache: Any = None) -> Any:
        """prepare_weight of the rows `rows` of raw (a part a file interleaves with another's); a backend
        whose cache holds them prepared may skip the gather."""
        return self.prepare_weight(np.ascontiguousarray(raw[rows]), ggml_type, cache)

    def prepare_vector(self, raw: np.ndarray, ggml_type: int) -> Any:
        """A small 1-D tensor (norm weight, bias) as float32."""
        raise NotImplementedError

    def allocate_kv(
        self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        cache_types: tuple[str, str] = ("f32", "f32"),
    ) -> tuple[Any, Any]:  # fmt: skip
        """Key and value pools: (n_layers, num_blocks, block_size, kv_heads, head_dim) each, in the
        element types named by cache_types (engine/kv_cache.py: "f32" or "f16")."""
        raise NotImplementedError

    def kv_block_to_host(self, pool: Any, block_id: int) -> np.ndarray:
        """A copy of one block of a K or V pool, (n_layers, block_size, kv_heads, head_dim), in the
        pool's own element type (the disk tier writes it)."""
        return np.array(pool[:, block_id])

    def kv_block_from_host(self, pool: Any, block_id: int, data: np.ndarray) -> None:
        """Overwrite one block of a K or V pool with `data`, as kv_block_to_host gave it."""
        pool[:, block_id] = data

    # ---- operations -----------------------------------------------------------------------------

    def linear(self, x: Any, weight: Any) -> Any:
        """x (T, K) times the (N, K) weight transposed -> (T, N)."""
        raise NotImplementedError

    def linear_precise(self, x: Any, weight: Any) -> Any:
        """linear for projections sensitive to activation rounding (logits, GeGLU's down)."""
        return self.linear(x, weight)

    def linear_many(self, x: Any, weights: Sequence[Any]) -> list[Any]:
        """[linear(x, w) for w in weights] for weights sharing their input (q/k/v, gate/up)."""
        return [self.linear(x, w) for w in weights]

    def embedding(self, weight: Any, ids: Any) -> Any:
        raise NotImplementedError

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm over the last axis."""
        raise NotImplementedError

    def swiglu(self, gate: Any, up: Any) -> Any:
        raise NotImplementedError

    def geglu(self, gate: Any, up: Any) -> Any:
        raise NotImplementedError

    def swiglu_oai(self, gate: Any, up: Any) -> Any:
        """gpt-oss's clamped SwiGLU (kernels/reference.swiglu_oai)."""
        raise NotImplementedError(f"the {self.name} backend has no clamped SwiGLU (gpt-oss)")

    def softcap(self, x: Any, cap: float) -> Any:
        """cap * tanh(x / cap) (gemma2's final logits)."""
        raise NotImplementedError

    def rope_store_kv(
        self, q: Any, k: Any, v: Any, positions: Any, rope: RopeSpec, k_cache: Any, v_cache: Any,
        slot_mapping: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        """(rope(q), rope(k)), with the rotated k and v written to the cache at slot_mapping."""
        raise NotImplementedError

    def paged_attention(
        self, q: Any, k_cache: Any, v_cache: Any, query_start_loc: Any, context_lens: Any,
        block_tables: Any, scale: float, window: int = 0, softcap: float = 0.0, sinks: Any = None,
    ) -> Any:  # fmt: skip
        """Causal grouped-query attention over the paged cache (see kernels/reference.py); sinks: the
        layer's attention-sink logits (n_heads,), passed only where the spec has them."""
        raise NotImplementedError

    def attn_temperature(self, q: Any, positions: Any, scale: float, length: int) -> Any:
        """q (T, heads, D) times each token's attention temperature (LayerSpec.attn_temp_scale)."""
        from localllm.models.spec import attn_temperature

        return q * attn_temperature(np.asarray(positions), scale, length)[:, None, None]

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    # ---- mixture of experts (runs_moe: whether a backend has these) -----------------------------

    runs_moe = False

    def moe_ffn(self, h: Any, lw: LayerWeights, spec: LayerSpec, router_in: Any = None) -> Any:
        """The routed experts' weighted sum for h (T, dim): lw's router, gate_exps, up_exps and
        down_exps, as the LayerSpec's experts_used / expert_renorm / activation / expert_scale say
        (kernels/moe_reference.py); the router reads router_in (T, dim) where given, else h."""
        raise NotImplementedError

    def sigmoid_gate(self, h: Any, weight: Any) -> Any:
        """(T, 1) sigmoid(h . weight): the shared expert's gate."""
        raise NotImplementedError

    def sigmoid_mul(self, x: Any, gate: Any) -> Any:
        """x * sigmoid(gate), element-wise (an attention output gate)."""
        raise NotImplementedError

    # ---- recurrent mixers (runs_gated_delta: whether a backend has these) -----------------------

    runs_gated_delta = False

    def gated_delta(
        self, qkv: Any, z: Any, beta: Any, alpha: Any, lw: LayerWeights, spec: LayerSpec, batch: ForwardBatch,
        conv_state: Any, ssm_state: Any, eps: float,
    ) -> Any:  # fmt: skip
        """A Gated DeltaNet layer between its input projections (qkv (T, conv channels), z (T, Hv*Dv),
        beta and alpha (T, Hv)) and its output projection: causal conv + silu, L2-normed q/k, the gated
        delta rule over each sequence's slot of conv_state (slots, taps-1, channels) and ssm_state
        (slots, Hv, Dv, Dk), updated in place, then the silu(z)-gated per-head norm. (T, Hv*Dv)."""
        raise NotImplementedError

    # ---- optional capabilities (defaults: not had) ----------------------------------------------

    def begin_step(self, batch: ForwardBatch, model: Transformer) -> ForwardBatch:
        """Called once per forward pass of `model` before any layer: where a device backend uploads the
        batch, and a backend with a thread governor sets the step's thread count."""
        return batch

    def thread_governor(self, model: Transformer) -> ThreadGovernor | None:
        """The governor picking the thread count of `model`'s steps from their timings (threads.py), one
        per model: a draft model's steps (a 1-token one ~2x faster than its target's) would mislead its
        target's choice. None: this backend's thread count is fixed."""
        return None

    samples_on_device = False

    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sampled]:
        """Where samples_on_device: row i of `logits` (a step's output, still on the device) sampled as
        rows[i] says, as localllm/sampler.py would; ends the step as to_numpy does."""
        raise NotImplementedError

    def run_layers(self, model: Transformer, x: Any, batch: ForwardBatch, kv: PagedKV) -> Any | None:
        """All of model's layers on x in one fused call, or None to have the model run them op by op."""
        return None

    def warmup(self, model: Transformer, cache_types: tuple[str, str] = ("f32", "f32")) -> None:
        """Compile (or load) what a step of `model` with such a KV cache runs, so no request pays."""

    def numerics(self) -> str:
        """What decides the bits this backend computes (its kernels, the CPU or device they run on):
        cached K/V is shared only between runs whose numerics are equal (engine/block_identity.py)."""
        return self.name

    def open_weight_cache(self, gf: GGUFFile, cache_dir: Path) -> Any | None:
        """A disk cache in cache_dir of this backend's prepared weights of `gf`, to pass to
        prepare_weight and then save() once the model has loaded; None: nothing here is worth caching."""
        return None
