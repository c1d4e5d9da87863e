"""Paged attention in torch ops: the step's plan (which sequences attend together, made on the host so
no layer reads a device value back), the causal masks, the gather through the block tables, and the
attention itself (torch's fused SDPA, or scores by hand where gemma2's soft-cap applies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from localllm.backends.torch_backend import kv_q8

SCORES_BUDGET = 64 * 2**20  # bytes of float32 scores one by-hand attention call holds at once


@dataclass(slots=True)
class Group:
    """Sequences attended together, each with Q queries: all decodes (Q = 1), or one prefill chunk
    (S = 1), so no query row is padding. `tokens` (S*Q,) are their rows of q, at positions `q_pos`
    (S, Q); keys up to `n_keys` are read through `tables` (S, blocks)."""

    tokens: torch.Tensor
    q_pos: torch.Tensor
    ctx: torch.Tensor  # (S,) context length after this step
    tables: torch.Tensor
    n_keys: int


@dataclass(slots=True)
class HostGroup:
    """A Group's index arrays on the host, before the step's one upload (uploads.py)."""

    tokens: np.ndarray
    q_pos: np.ndarray
    ctx: np.ndarray
    tables: np.ndarray
    n_keys: int

    def arrays(self) -> list[np.ndarray]:
        return [self.tokens, self.q_pos, self.ctx, self.tables]


def plan(qsl: np.ndarray, ctx: np.ndarray, tables: np.ndarray) -> list[HostGroup]:
    """One group for all single-query sequences (decodes), one per multi-query sequence (prefill
    chunks): padding decodes to a shared key length is cheap, padding prefills to each other is not."""
    qlens = np.diff(qsl)
    decodes = np.flatnonzero(qlens == 1)
    groups = [_group(qsl, ctx, tables, decodes, 1)] if len(decodes) else []
    for s in np.flatnonzero(qlens > 1):
        groups.append(_group(qsl, ctx, tables, np.array([s]), int(qlens[s])))
    return groups


def _group(qsl: np.ndarray, ctx: np.ndarray, tables: np.ndarray, seqs: np.ndarray, q: int) -> HostGroup:
    lens = ctx[seqs]
    offsets = np.arange(q)[None, :]
    tokens = (qsl[seqs][:, None] + offsets).reshape(-1)
    return HostGroup(tokens, lens[:, None] - q + offsets, lens, tables[seqs], int(lens.max()))


def on_device(groups: list[HostGroup], uploaded: list[torch.Tensor]) -> list[Group]:
    """The groups over their uploaded arrays (four per group, in HostGroup.arrays order)."""
    out = []
    for i, g in enumerate(groups):
        tokens, q_pos, ctx, tables = uploaded[4 * i : 4 * i + 4]
        out.append(Group(tokens, q_pos, ctx, tables, g.n_keys))
    return out


def static_group(batch: Any, block_size: int) -> Group:
    """A static decode batch (device tensors under ForwardBatch's names) as one decode group over all
    W blocks of every table (device values only)."""
    b, w = batch.block_tables.shape
    tokens = torch.arange(b, device=batch.block_tables.device)
    q_pos = (batch.context_lens - 1)[:, None]
    return Group(tokens, q_pos, batch.context_lens, batch.block_tables, w * block_size)


def in_layer(g: Group, factor: int) -> Group:
    """g for a layer whose cache view has `factor` blocks per pool block (pool block b is its b * factor)."""
    return g if factor == 1 else Group(g.tokens, g.q_pos, g.ctx, g.tables * factor, g.n_keys)


def causal_mask(g: Group, window: int) -> torch.Tensor:
    """(S, 1, 1, Q, L) keys each query sees: its own and earlier positions, within `window`."""
    k_pos = torch.arange(g.n_keys, device=g.q_pos.device)[None, None, :]
    q_pos = g.q_pos[:, :, None]
    mask = (k_pos <= q_pos) & (k_pos < g.ctx[:, None, None])
    if window > 0:
        mask &= k_pos > q_pos - window
    return mask[:, None, None, :, :]


def attend_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: Group, mask: torch.Tensor,
    scale: float, softcap: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """(S*Q, H, D) attention outputs of the group's (padded) query rows; sinks (H,): each head's
    attention-sink logit (gpt-oss), or None."""
    n_heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    s, nq = g.q_pos.shape
    # (S, KVH, G, Q, D): query head h reads kv head h // G, as the reference groups them
    rows = q[g.tokens].float()
    if k_cache.dtype == torch.int8:  # a q8_0 K cache: the query rotated as the keys were, then rounded
        rows = kv_q8.rounded_query(kv_q8.hadamard(rows, kv_q8.key_rotation(dim)))
    qg = rows.view(s, nq, kv_heads, n_heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    keys, values = (_gather(c, g) for c in (k_cache, v_cache))  # (S, KVH, 1, L, D)
    if softcap > 0 or sinks is not None:
        group_sinks = None if sinks is None else sinks.float().view(1, kv_heads, n_heads // kv_heads, 1, 1)
        out = _explicit_attention(qg, keys, values, mask, scale, softcap, group_sinks)
    else:
        out = _sdpa(qg, keys, values, mask, scale)
    out = out.permute(0, 3, 1, 2, 4).reshape(s * nq, n_heads, dim)
    return kv_q8.hadamard(out, kv_q8.value_rotation(dim)) if v_cache.dtype == torch.int8 else out


def _gather(cache: torch.Tensor, g: Group) -> torch.Tensor:
    """The group's first n_keys positions, read through its block tables -> (S, KVH, 1, L, D)."""
    bs = cache.shape[1]
    n_blocks = -(-g.n_keys // bs)
    blocks = cache[g.tables[:, :n_blocks]]  # (S, n_blocks, bs, KVH, D)
    s = blocks.shape[0]
    seq = blocks.reshape(s, n_blocks * bs, *cache.shape[2:])[:, : g.n_keys]
    seq = kv_q8.dequantize_rows(seq) if cache.dtype == torch.int8 else seq.float()
    return seq.permute(0, 2, 1, 3)[:, :, None]


def _explicit_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float, sinks: torch.Tensor | None, budget: int = SCORES_BUDGET,
) -> torch.Tensor:  # fmt: skip
    """Scores by hand, for what SDPA cannot do: cap * tanh(score / cap) before the softmax (gemma2),
    and sinks (1, KVH, G, 1, 1), a logit per query head that joins the softmax's denominator and adds
    no value (gpt-oss), as kernels/reference.py: max over the scores and the sink, exp, divide. The
    queries go in chunks whose float32 scores fit `budget` bytes (a row's result does not depend on its
    chunk): a 512-token prefill chunk over 4,096 keys at 64 heads would otherwise hold 512 MiB of them."""
    s, kvh, group, nq, _ = q.shape
    per_query = 4 * s * kvh * group * keys.shape[-2]
    step = max(1, budget // max(1, per_query))
    if step >= nq:
        return _scored_attention(q, keys, values, mask, scale, softcap, sinks)
    parts = []
    for i in range(0, nq, step):
        chunk, visible = q[:, :, :, i : i + step], mask[..., i : i + step, :]
        parts.append(_scored_attention(chunk, keys, values, visible, scale, softcap, sinks))
    return torch.cat(parts, dim=3)


def _scored_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True) + torch.exp(sinks - top)
    return torch.matmul(p / total, values)


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
