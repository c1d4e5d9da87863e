"""The Gated DeltaNet mixer (Qwen3.5, Qwen3-Next linear attention), op by op over the backend.

Projections q|k|v (one matrix, the conv's channels), z (the output gate), beta and alpha (per value
head); the backend's gated_delta runs the conv, the delta rule over each sequence's state slot and the
gated norm (kernels/gated_delta.py); the output projection brings it back to the model's width. The
states live in the engine's pool, kv.states (engine/state_cache.py), found by batch.state_slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localllm.models.batch import ForwardBatch, PagedKV
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.backends.base import Backend


def gated_delta_net(
    b: Backend, args: ModelArgs, spec: LayerSpec, lw: Any, h: Any, batch: ForwardBatch, kv: PagedKV,
    il: int,
) -> Any:  # fmt: skip
    """The layer's mixer output (T, dim) for the normed input h, its state slots advanced; lw is the
    layer's layers.LayerWeights (typed Any: layers imports this module)."""
    qkv, z, beta, alpha = b.linear_many(h, [lw.ssm_qkv, lw.ssm_z, lw.ssm_beta, lw.ssm_alpha])
    conv_state, ssm_state = kv.states.layer(il)
    out = b.gated_delta(qkv, z, beta, alpha, lw, spec, batch, conv_state, ssm_state, args.norm_eps)
    return b.linear(out, lw.ssm_out)
