"""The one decoder layer every architecture runs, op by op over the backend, as its LayerSpec says.

A backend with a fused stack (the Numba one) runs the same layer from the same spec in one compiled
call; this is the reference it is tested against and the path every other backend takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from localllm.models.base import ForwardBatch, PagedKV, WeightLoader
from localllm.models.spec import LayerSpec, ModelArgs

if TYPE_CHECKING:
    from localllm.backends.base import Backend

MATRICES = frozenset({"wq", "wk", "wv", "wo", "gate", "up", "down", "router", "ple_gate", "ple_proj", "wg",
                      "ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha", "ssm_out"})  # fmt: skip
EXPERTS = frozenset({"gate_exps", "up_exps", "down_exps"})  # one matrix per expert
EXPERT_BIASES = ("gate_exps_b", "up_exps_b", "down_exps_b")  # (experts, rows): one bias row per expert


@dataclass(slots=True)
class LayerWeights:
    """A layer's tensors as the backend prepared them; the optional ones are None unless the spec
    asks for them."""

    attn_norm: Any
    ffn_norm: Any
    wq: Any = None  # attention (None in a recurrent layer)
    wk: Any = None  # None also on a layer that attends another's KV cache (spec.kv_source)
    wv: Any = None
    wo: Any = None
    gate: Any = None  # the dense FFN (a mixture-of-experts layer's shared expert), None where none
    up: Any = None
    down: Any = None
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None
    router: Any = None  # (experts, dim): each token's expert logits
    gate_exps: tuple = ()  # one (expert_ffn_dim, dim) matrix per expert
    up_exps: tuple = ()
    down_exps: tuple = ()
    shexp_gate: Any = None  # (dim,): the shared expert's sigmoid gate
    sinks: Any = None  # (n_heads,) attention-sink logits
    bo: Any = None  # (dim,) output projection bias
    router_b: Any = None  # (experts,) router logit bias
    gate_exps_b: Any = None  # (experts, expert_ffn_dim)
    up_exps_b: Any = None
    down_exps_b: Any = None  # (experts, dim)
    down_exps_s: Any = None  # (experts,): each expert's down output scale (spec.expert_scale)
    # gemma4's parallel experts (spec.parallel_experts): the experts' input norm, the dense FFN's and the
    # experts' output norms, and the router's input norm weight (ffn_gate_inp.scale / sqrt(dim))
    ffn_norm_2: Any = None
    post_ffn_norm_1: Any = None
    post_ffn_norm_2: Any = None
    router_norm: Any = None
    v_norm: Any = None  # (head_dim,) ones: v's weightless RMSNorm (spec.v_norm)
    ple_gate: Any = None  # (per_layer_dim, dim), (dim, per_layer_dim), (dim,): the per-layer input's
    ple_proj: Any = None  # gate, projection and norm (ModelArgs.per_layer_dim)
    ple_norm: Any = None
    wg: Any = None  # (n_heads * head_dim, dim): the attention output gate (attn_gate)
    # Gated DeltaNet (models/gated_delta.py): input projections, conv taps (channels * taps floats),
    # dt bias, decay speeds a = -exp(A_log), the per-head output norm and the output projection
    ssm_qkv: Any = None
    ssm_z: Any = None
    ssm_beta: Any = None
    ssm_alpha: Any = None
    ssm_conv: Any = None
    ssm_dt: Any = None
    ssm_a: Any = None
    ssm_norm: Any = None
    ssm_out: Any = None


PARALLEL_EXPERT_NORMS = ("ffn_norm_2", "post_ffn_norm_1", "post_ffn_norm_2", "router_norm")
SSM_FIELDS = ("ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha", "ssm_conv", "ssm_dt", "ssm_a", "ssm_norm",
              "ssm_out")  # fmt: skip


def wanted(spec: LayerSpec, per_layer_input: bool = False) -> list[str]:
    """The LayerWeights fields a layer of this spec needs (all of them required)."""
    names = ["attn_norm", "ffn_norm"]
    if spec.mixer == "gated_delta_net":
        names += list(SSM_FIELDS)
    else:
        stores = spec.kv_source < 0  # a layer attending an earlier layer's cache projects no k or v
        names += ["wq", "wo"] + (["wk"] if stores else [])
        names += ["wv"] if stores and not spec.v_from_k else []
    names += ["wg"] if spec.attn_gate else []
    names += ["gate", "up", "down"] if spec.dense_ffn else []
    names += ["router", "gate_exps", "up_exps", "down_exps"] if spec.experts else []
    names += ["shexp_gate"] if spec.shared_expert else []
    names += list(PARALLEL_EXPERT_NORMS) if spec.parallel_experts else []
    names += ["down_exps_s"] if spec.expert_scale else []
    names += ["bq", "bk", "bv"] if spec.qkv_bias else []
    names += (["q_norm", "k_norm"] if stores else ["q_norm"]) if spec.qk_norm else []
    names += ["post_attn_norm"] if spec.post_attn_norm else []
    names += ["post_ffn_norm"] if spec.post_ffn_norm else []
    names += ["sinks"] if spec.attn_sinks else []
    names += ["bo"] if spec.o_bias else []
    names += ["router_b"] if spec.router_bias else []
    names += list(EXPERT_BIASES) if spec.expert_bias else []
    names += ["ple_gate", "ple_proj", "ple_norm"] if per_layer_input else []
    return names


def fused_rows(args: ModelArgs) -> dict[str, tuple[str, int, int]]:
    """Matrices a file stores fused (phi3): field -> (tensor, first row, end row). Rows of a matrix are
    independent, quantized ones included, so a row range of the fused tensor is the separate weight."""
    out: dict[str, tuple[str, int, int]] = {}
    if args.fused_qkv:
        nq, nkv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        out.update(wq=("attn_qkv.weight", 0, nq), wk=("attn_qkv.weight", nq, nq + nkv))
        out["wv"] = ("attn_qkv.weight", nq + nkv, nq + 2 * nkv)
    if args.fused_gate_up:  # gate first: llama.cpp's swiglu takes silu of the first half
        f = args.ffn_dim
        out.update(gate=("ffn_up.weight", 0, f), up=("ffn_up.weight", f, 2 * f))
    if args.fused_gate_up_exps:  # per expert: gate rows, then up rows (gemma4's ffn_gate_up_exps)
        f = next(s.expert_ffn_dim for s in args.layers if s.experts)
        out.update(gate_exps=("ffn_gate_up_exps.weight", 0, f), up_exps=("ffn_gate_up_exps.weight", f, 2 * f))
    return out


def gathered_rows(args: ModelArgs) -> dict[str, tuple[str, np.ndarray]]:
    """Matrices whose rows a file interleaves with another's: field -> (tensor, row ids). A gated q
    projection holds per head head_dim rows of q, then head_dim of its gate (qwen35); a fused ssm_ba
    per key head its value heads' beta rows, then their alpha rows (qwen3next)."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    if any(s.attn_gate for s in args.layers):
        hd = args.head_dim
        rows = np.arange(2 * args.n_heads * hd).reshape(args.n_heads, 2, hd)
        out.update(wq=("attn_q.weight", rows[:, 0].ravel()), wg=("attn_q.weight", rows[:, 1].ravel()))
    spec = next((s for s in args.layers if s.mixer == "gated_delta_net"), None)
    if args.fused_ba and spec is not None:
        r = spec.ssm_v_heads // spec.ssm_k_heads
        rows = np.arange(2 * spec.ssm_v_heads).reshape(spec.ssm_k_heads, 2, r)
        out.update(
            ssm_beta=("ssm_ba.weight", rows[:, 0].ravel()), ssm_alpha=("ssm_ba.weight", rows[:, 1].ravel())
        )
    return out


def load_layer(
    w: WeightLoader, il: int, spec: LayerSpec, names: dict[str, str], fused: dict[str, tuple[Any, ...]],
    head_dim: int = 0, per_layer_input: bool = False,
) -> LayerWeights:  # fmt: skip
    values = {}
    for field in wanted(spec, per_layer_input):
        if field in fused and field in EXPERTS:  # a row range of every expert's matrix
            name, *rows = fused[field]
            values[field] = w.experts(f"blk.{il}.{name}", (rows[0], rows[1]))
            continue
        if field in fused:
            name, *rows = fused[field]
            values[field] = w.matrix(f"blk.{il}.{name}", rows[0] if len(rows) == 1 else tuple(rows))
            continue
        name = f"blk.{il}.{names[field]}"
        if field in EXPERTS:
            values[field] = w.experts(name)
        elif field in EXPERT_BIASES:
            values[field] = w.vector(name).reshape(spec.experts, -1)
        else:
            values[field] = w.matrix(name) if field in MATRICES else w.vector(name)
    if spec.v_from_k and "wk" in values:  # the same prepared matrix: q/k/v launch as ever, k twice
        values["wv"] = values["wk"]
    if spec.v_norm:
        values["v_norm"] = w.ones(head_dim)
    if spec.parallel_experts:  # the router input's 1 / sqrt(dim), folded into its norm's weight
        norm: Any = values["router_norm"]
        values["router_norm"] = norm * float(1.0 / np.sqrt(norm.shape[0]))
    return LayerWeights(**values)


def _add_bias(y: Any, bias: Any) -> Any:
    return y if bias is None else y + bias


def self_attention(
    b: Backend,
    args: ModelArgs,
    spec: LayerSpec,
    lw: LayerWeights,
    h: Any,
    batch: ForwardBatch,
    kv: PagedKV,
    il: int,
) -> Any:
    """Project to q/k/v, normalise and rotate, write k/v into the paged cache, attend, project out
    (a layer with a kv_source only projects q, and attends that layer's cache; the attention times
    sigmoid of its gate first, where the spec has one)."""
    n_tokens, hd, kvh = h.shape[0], args.head_dim_of(il), args.kv_heads_of(il)
    stores = spec.kv_source < 0
    k_cache, v_cache = kv.layer(il if stores else spec.kv_source)
    slots, tables = _layer_slots(batch, k_cache.shape[0] // kv.num_blocks, kv.block_size)
    gated = [lw.wg] if spec.attn_gate else []
    if stores:
        q, k, v, *gate = b.linear_many(h, [lw.wq, lw.wk, lw.wv] + gated)
        k = _add_bias(k, lw.bk).reshape(n_tokens, kvh, hd)
        v = _add_bias(v, lw.bv).reshape(n_tokens, kvh, hd)
    else:
        q, *gate = b.linear_many(h, [lw.wq] + gated)
    q = _add_bias(q, lw.bq).reshape(n_tokens, args.n_heads, hd)
    if spec.qk_norm:
        q = b.rms_norm(q, lw.q_norm, args.norm_eps)
    if stores:
        k = b.rms_norm(k, lw.k_norm, args.norm_eps) if spec.qk_norm else k
        v = b.rms_norm(v, lw.v_norm, args.norm_eps) if spec.v_norm else v
        q, k = b.rope_store_kv(q, k, v, batch.positions, spec.rope, k_cache, v_cache, slots)
    else:  # rotate q alone: zero KV heads stored (writes nothing)
        none, kc, vc = q[:, :0], k_cache[:, :, :0], v_cache[:, :, :0]
        q, _ = b.rope_store_kv(q, none, none, batch.positions, spec.rope, kc, vc, slots)
    sinks = {"sinks": lw.sinks} if spec.attn_sinks else {}  # (backends without sinks never see the word)
    if spec.attn_temp_scale:
        q = b.attn_temperature(q, batch.positions, spec.attn_temp_scale, spec.attn_temp_length)
    out = b.paged_attention(
        q, k_cache, v_cache, batch.query_start_loc, batch.context_lens, tables,
        args.attn_scale, spec.window, spec.attn_softcap, **sinks,
    )  # fmt: skip
    out = out.reshape(n_tokens, args.n_heads * hd)
    out = b.linear(b.sigmoid_mul(out, gate[0]) if gate else out, lw.wo)
    return _add_bias(out, lw.bo) if spec.o_bias else out


def _layer_slots(batch: ForwardBatch, factor: int, block_size: int) -> tuple[Any, Any]:
    """The batch's slot mapping and block tables in a layer's own blocks (see KVCache.layer): pool
    block b is its block b * factor; slot -1 (store nothing) stays -1."""
    slots, tables = batch.slot_mapping, batch.block_tables
    if factor == 1:
        return slots, tables
    return slots + (slots >= 0) * (slots // block_size) * ((factor - 1) * block_size), tables * factor


def feed_forward(b: Backend, spec: LayerSpec, lw: LayerWeights, x: Any, eps: float) -> Any:
    """The FFN of x, the residual stream after attention: the dense FFN or the routed experts' weighted
    sum (plus the gated shared expert) of rms_norm(x), or gemma4's parallel dense FFN and experts."""
    if spec.parallel_experts:
        return parallel_experts(b, spec, lw, x, eps)
    h = b.rms_norm(x, lw.ffn_norm, eps)
    if not spec.experts:
        return dense_ffn(b, spec, lw, h)
    out = b.moe_ffn(h, lw, spec)
    if spec.shared_expert:
        out = out + dense_ffn(b, spec, lw, h) * b.sigmoid_gate(h, lw.shexp_gate)
    return out


def parallel_experts(b: Backend, spec: LayerSpec, lw: LayerWeights, x: Any, eps: float) -> Any:
    """gemma4: norm1(dense(norm(x))) + norm2(experts(norm_2(x))), routed on rms_norm(x) * router_norm."""
    dense = b.rms_norm(dense_ffn(b, spec, lw, b.rms_norm(x, lw.ffn_norm, eps)), lw.post_ffn_norm_1, eps)
    routed = b.moe_ffn(b.rms_norm(x, lw.ffn_norm_2, eps), lw, spec, b.rms_norm(x, lw.router_norm, eps))
    return dense + b.rms_norm(routed, lw.post_ffn_norm_2, eps)


def dense_ffn(b: Backend, spec: LayerSpec, lw: LayerWeights, h: Any) -> Any:
    gate, up = b.linear_many(h, [lw.gate, lw.up])
    act = {"silu": b.swiglu, "gelu_tanh": b.geglu, "swiglu_oai": b.swiglu_oai}[spec.activation](gate, up)
    return (b.linear_precise if spec.precise_down else b.linear)(act, lw.down)


def decoder_layer(
    b: Backend, args: ModelArgs, il: int, lw: LayerWeights, x: Any, batch: ForwardBatch, kv: PagedKV,
    per_layer: Any = None,
) -> Any:  # fmt: skip
    """x + attention(norm(x)), then + feed_forward(norm(x)), each output optionally normalised; then
    + the per-layer input's term where `per_layer` (T, per_layer_dim) is given."""
    from localllm.models.gated_delta import gated_delta_net

    spec, eps = args.layers[il], args.norm_eps
    mixer = gated_delta_net if spec.mixer == "gated_delta_net" else self_attention
    h = mixer(b, args, spec, lw, b.rms_norm(x, lw.attn_norm, eps), batch, kv, il)
    x = x + (b.rms_norm(h, lw.post_attn_norm, eps) if spec.post_attn_norm else h)
    h = feed_forward(b, spec, lw, x, eps)
    x = x + (b.rms_norm(h, lw.post_ffn_norm, eps) if spec.post_ffn_norm else h)
    if per_layer is not None:  # gelu(x @ gate) * this layer's input, projected back and normed
        g = b.geglu(b.linear(x, lw.ple_gate), per_layer)
        x = x + b.rms_norm(b.linear(g, lw.ple_proj), lw.ple_norm, eps)
    return x if spec.out_scale == 1.0 else x * np.float32(spec.out_scale)
