"""The fused stacks' scratch arena (kernels/decoder.py's _buffers_in, hybrid_decoder's _rec_buffers):
buffers that are live at the same time never share memory, and the hybrid stack's recurrent-layer
scratch lies inside the decoder's arena instead of beside it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from localllm.kernels import decoder as dk
from localllm.kernels import hybrid_decoder as hd


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.ctypes.data
    return start, start + a.nbytes


def _disjoint(arrays: dict[str, np.ndarray]) -> None:
    for (na, a), (nb, b) in itertools.combinations(arrays.items(), 2):
        (a0, a1), (b0, b1) = _span(a), _span(b)
        assert a1 <= b0 or b1 <= a0, f"{na} and {nb} overlap"


# (n_heads, n_kv_heads, head_dim, ffn) x (n_k, n_v, ssm head_dim): Qwen3.5 0.8B-like, an MoE-like
# model whose dense FFN is small (the recurrent scratch outgrows the decoder's), a tiny one
SHAPES = [((8, 2, 256, 3584), (16, 16, 128)), ((16, 2, 256, 512), (16, 32, 128)), ((2, 1, 8, 16), (2, 4, 4))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 7, 64])
def test_live_buffers_never_overlap(shape, T):
    (nq, nkv, hd_, ffn), (n_k, n_v, sd) = shape
    dims = dk.Dims(nq, nkv, hd_, ffn, 1e-6, 1.0, False)
    rd = hd.RecDims(n_k, n_v, sd, (2 * n_k + n_v) * sd, False)
    d = 64
    arena = hd._arena(T, d, dims, rd)
    buf = dk._buffers_in(arena, T, d, dims, 1, 4)
    rb = hd._rec_buffers(arena, T, dims, rd)
    base = {f: getattr(buf, f) for f in ("h", "q", "k", "v", "kn", "att", "o", "gate", "up", "act", "down")}
    _disjoint(base)  # an attention block and an FFN block use all of them
    rec = {f: getattr(rb, f) for f in ("qkv", "z", "beta", "alpha", "mixed", "o")}
    _disjoint({**rec, "h": buf.h, "x-out": buf.o})  # a delta-net block: its scratch, its input, its output
    gated = {f: base[f] for f in ("h", "q", "k", "v", "kn", "att", "o")}
    _disjoint({**gated, "gate": rb.gate})  # a gated attention block
    lo, hi = _span(arena)
    for name, a in {**rec, "gate": rb.gate}.items():  # inside the arena: no second allocation
        a0, a1 = _span(a)
        assert lo <= a0 and a1 <= hi, name
    assert arena.size == max(dk._arena_sizes(T, d, dims).sum(), sum(a.size for a in rec.values()),
                             _span(rb.gate)[1] // 4 - lo // 4)  # fmt: skip
    assert rb.qkv.shape == (T, rd.channels) and rb.gate.shape == (T, nq, hd_)
