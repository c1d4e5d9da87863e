"""Sampling on the device: the host sampler's rules (localllm/sampler.py) for a whole batch of logits
rows, so the logits never leave the device; one device-to-host copy per step brings back the sampled
ids and the log-probabilities asked for.

The same numbers as the host, step for step: logit_bias, the repeat penalty and the presence/frequency
penalties in the host's order and float types; greedy is the first largest logit; otherwise the
likeliest-first distribution after temperature, top-k, top-p and min-p in float64, then NumPy's
`Generator.choice` rule (cumulative sum, normalised by its last value, the first entry above a uniform
draw). The uniform is drawn on the host from the very generator the host sampler would use (the
per-(seed, position) stream, or the sequence's shared one), so a seed gives the same tokens on either
side; only sums taken in another order differ, in the last bits. Grammar masks travel as packed bits
(1 bit per token). Log-probabilities are of the raw logits, before penalties and masks, as the host's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from localllm.backends.base import Sampled, SampleRow
from localllm.backends.torch_backend.uploads import upload_one
from localllm.sampler import token_generator


def sample_batch(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
    """Row i of logits (R, V) sampled as rows[i] says; one copy to the host at the end."""
    dev, vocab = logits.device, logits.shape[1]
    raw = logits.float()
    x = _penalised(raw, rows)
    x = _masked(x, rows)
    host_table = _row_table(rows, vocab)
    tokens = x.argmax(dim=-1)
    if not host_table[:, 0].all():  # some row draws at random
        tokens = _choose(x, upload_one(host_table, dev).to(_wide(dev)), tokens)
    num_top = max((r.params.logprobs or 0) for r in rows)
    wants = any(r.params.logprobs is not None for r in rows)
    wide = _wide(dev)
    parts = [tokens.to(wide)[:, None]]
    if wants:
        parts += _logprob_parts(raw, tokens, num_top)
    host = torch.cat(parts, dim=1).cpu().numpy()  # the one device-to-host copy
    return [_unpack(host[i], r.params.logprobs, num_top) for i, r in enumerate(rows)]


def _row_table(rows: Sequence[SampleRow], vocab: int) -> np.ndarray:
    """(R, 6) float64: greedy, temperature, top-k (0: all), top-p, min-p, the uniform draw."""
    table = np.zeros((len(rows), 6), dtype=np.float64)
    for i, r in enumerate(rows):
        p = r.params
        if p.greedy:  # (a harmless distribution: the argmax is taken)
            table[i] = (1.0, 1.0, vocab, 1.0, 0.0, 0.0)
            continue
        k = p.top_k if 0 < p.top_k < vocab else vocab
        u = token_generator(p.seed, r.rng, len(r.output_ids)).random()
        table[i, 1:] = (p.temperature, k, p.top_p, p.min_p, u)
    return table


# ---- penalties and masks --------------------------------------------------------------------------------


def _penalised(x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """apply_penalties for every row at once: bias, then repeat, then presence/frequency."""
    bias, rep, pres = _penalty_indices(rows, x.shape[1])
    if not (len(bias[0]) or len(rep[0]) or len(pres[0])):
        return x
    x = x.clone()
    dev = x.device
    if len(bias[0]):
        r, t, v = (upload_one(a, dev) for a in bias)
        x.index_put_((r, t), v, accumulate=True)
    if len(rep[0]):
        r, t, div = (upload_one(a, dev) for a in rep)
        vals = x[r, t]
        x[r, t] = torch.where(vals > 0, vals / div, vals * div)
    if len(pres[0]):
        r, t = (upload_one(a, dev) for a in pres[:2])
        amount = upload_one(pres[2], dev).to(_wide(dev))  # (MPS: float32, cast on the device)
        x[r, t] = (x[r, t].to(amount.dtype) - amount).float()
    return x


def _wide(dev: torch.device) -> torch.dtype:
    """float64 as the host computes penalties in, where the device has it (MPS has not)."""
    return torch.float32 if dev.type == "mps" else torch.float64


Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


def _penalty_indices(rows: Sequence[SampleRow], vocab: int) -> tuple[Triple, Triple, Triple]:
    """(rows, tokens, values) for logit_bias (float32 biases), the repeat penalty (float32 divisors)
    and presence/frequency (float64 amounts), each token once per row as the host's np.unique."""
    out: list[tuple[list, list, list]] = [([], [], []), ([], [], []), ([], [], [])]
    for i, r in enumerate(rows):
        p = r.params
        for token_id, b in p.logit_bias.items():
            if 0 <= token_id < vocab:
                _extend(out[0], i, [token_id], [b])
        if p.repeat_penalty != 1.0:
            history = list(r.prompt_ids) + list(r.output_ids)
            window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n :]
            seen = np.unique(np.asarray(window, dtype=np.int64))
            _extend(out[1], i, seen, [p.repeat_penalty] * len(seen))
        if (p.presence_penalty or p.frequency_penalty) and len(r.output_ids):
            ids, counts = np.unique(np.asarray(r.output_ids, dtype=np.int64), return_counts=True)
            _extend(out[2], i, ids, p.presence_penalty + p.frequency_penalty * counts)
    types = (np.float32, np.float32, np.float64)
    return tuple(  # type: ignore[return-value]
        (np.asarray(a, np.int64), np.asarray(b, np.int64), np.asarray(c, t))
        for (a, b, c), t in zip(out, types, strict=True)
    )


def _extend(
    lists: tuple[list, list, list], row: int, tokens: Sequence[int] | np.ndarray, values: Any
) -> None:
    lists[0].extend([row] * len(tokens))
    lists[1].extend(int(t) for t in tokens)
    lists[2].extend(float(v) for v in values)


def pack_allowed(allowed: np.ndarray, vocab: int) -> np.ndarray:
    """A bool (vocab,) mask as bytes, 8 tokens a byte, token t at bit t % 8 of byte t // 8."""
    mask = np.zeros(vocab, dtype=bool)
    mask[: min(vocab, len(allowed))] = allowed[:vocab]
    return np.packbits(mask, bitorder="little")


def _masked(x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Tokens a row's grammar refuses set to -inf: the packed bits go up, are unpacked there."""
    which = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not which:
        return x
    vocab, dev = x.shape[1], x.device
    packed = np.stack([pack_allowed(rows[i].allowed, vocab) for i in which])  # type: ignore[arg-type]
    bits = upload_one(packed, dev).to(torch.int32)
    shifts = torch.arange(8, device=dev, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(which), -1)[:, :vocab]
    idx = upload_one(np.asarray(which, dtype=np.int64), dev)
    x = x.clone()
    x[idx] = torch.where(allowed, x[idx], float("-inf"))
    return x


# ---- the draw ----------------------------------------------------------------------------------------


def _choose(x: torch.Tensor, table: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """(R,) sampled ids: `greedy` (the argmax) for greedy rows, the host's distribution and draw for
    the others."""
    vocab = x.shape[1]
    scaled = x.to(table.dtype) / table[:, 1:2]
    sorted_s, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    in_k = rank < table[:, 2:3]
    weights = torch.where(in_k, torch.exp(sorted_s - sorted_s[:, :1]), 0.0)
    probs = weights / weights.sum(-1, keepdim=True)
    keep = _keep(probs, table)
    p = torch.where(rank < keep[:, None], probs, 0.0)
    p = p / p.sum(-1, keepdim=True)
    cdf = p.cumsum(-1)
    cdf = cdf / cdf.gather(1, (keep - 1)[:, None])
    idx = ((cdf <= table[:, 5:6]) & (rank < keep[:, None])).sum(-1).clamp(max=vocab - 1)
    drawn = order.gather(1, idx[:, None])[:, 0]
    return torch.where(table[:, 0] > 0, greedy, drawn)


def _keep(probs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """How many of the likeliest survive top-k, top-p (the first whose running sum reaches top_p)
    and min-p (at least one), per row."""
    top_k, top_p, min_p = table[:, 2].long(), table[:, 3:4], table[:, 4:5]
    by_p = (probs.cumsum(-1) < top_p).sum(-1) + 1
    by_p = torch.where(top_p[:, 0] < 1.0, by_p, top_k)
    by_min = (probs >= min_p * probs[:, :1]).sum(-1).clamp(min=1)
    by_min = torch.where(min_p[:, 0] > 0.0, by_min, top_k)
    return torch.minimum(top_k, torch.minimum(by_p, by_min))


# ---- log-probabilities ------------------------------------------------------------------------------


def _logprob_parts(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[torch.Tensor]:
    """The sampled token's log-probability, then num_top (id, log-probability) pairs, best first."""
    wide = _wide(raw.device)
    lp = torch.log_softmax(raw.to(wide), dim=-1).float()
    parts = [lp.gather(1, tokens[:, None]).to(wide)]
    if num_top > 0:
        values, ids = torch.topk(lp, num_top, dim=-1)
        parts += [ids.to(wide), values.to(wide)]
    return parts


def _unpack(row: np.ndarray, asked: int | None, num_top: int) -> Sampled:
    token = int(row[0])
    if asked is None:
        return Sampled(token)
    tops = [(int(row[2 + j]), float(np.float32(row[2 + num_top + j]))) for j in range(asked)]
    return Sampled(token, float(np.float32(row[1])), tops)
