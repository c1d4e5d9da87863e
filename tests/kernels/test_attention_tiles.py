"""The tiled attention kernel (kernels/attention_tiles.py through attention.py) at the edges of its
tiles: contexts that are no multiple of the tile or the block, windows that start inside a tile, one
query and many, GQA groups of 1 to 8, head sizes 64 to 256, f32 and f16 caches, sinks and soft-capping,
against the NumPy twin; and a query's output bits are the same alone, at any place in a prefill chunk,
and beside other sequences."""

from __future__ import annotations

import numpy as np
import pytest

from localllm.kernels import attention, layers
from localllm.kernels import reference as ref
from localllm.kernels.attention_tiles import TILE


def _pool(rng, lengths, kvh, d, bs, dtype):
    """K and V caches holding each sequence's random keys and values at scattered blocks, its
    block table, and the caches as float32 (what the twin reads)."""
    need = [(n + bs - 1) // bs for n in lengths]
    blocks = rng.permutation(sum(need) + 2)
    caches = [np.zeros((len(blocks), bs, kvh, d), dtype) for _ in range(2)]
    tables = np.zeros((len(lengths), max(need)), np.int64)
    start = 0
    for s, (n, nb) in enumerate(zip(lengths, need, strict=True)):
        tables[s, :nb] = blocks[start : start + nb]
        start += nb
        k, v = rng.standard_normal((2, n, kvh, d)).astype(np.float32) * 2
        pos = np.arange(n)
        layers.store_kv_rows(*caches, k, v, tables[s, pos // bs] * bs + pos % bs)
    floats = [c.view(np.float16).astype(np.float32) if dtype == np.uint16 else c for c in caches]
    return caches, tables, floats


def _run(q, caches, qsl, ctx, tables, window=0, softcap=0.0, sinks=None, threads=1):
    out = np.empty_like(q)
    s = np.empty(0, np.float32) if sinks is None else sinks
    args = (q, *caches, qsl, ctx, tables, 0.125, window, softcap, s, out)
    if threads == 1:
        attention.paged_attention_sinks_serial(*args)
    else:
        attention.paged_attention_sinks_par(*args, threads)
    return out


CASES = [  # heads, kv heads, head size, block size, context lengths, queries per sequence
    (4, 4, 64, 16, [131], [1]),
    (6, 2, 64, 16, [200, 64], [37, 64]),
    (9, 3, 64, 12, [150, 5, 77], [40, 1, 77]),
    (14, 2, 64, 16, [257], [16]),
    (8, 1, 128, 4, [97, 129], [1, 30]),
    (4, 2, 256, 16, [70], [9]),
    (6, 3, 48, 8, [66], [66]),  # a head size that is no multiple of 32
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-D{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("dtype", [np.float32, np.uint16], ids=["f32", "f16"])
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (70, 0.0, True), (5, 30.0, False)])
def test_tiled_attention_matches_the_numpy_twin(case, dtype, window, softcap, sinks) -> None:
    heads, kvh, d, bs, lengths, nq = case
    rng = np.random.default_rng(heads * d + bs)
    caches, tables, floats = _pool(rng, lengths, kvh, d, bs, dtype)
    qsl = np.concatenate([[0], np.cumsum(nq)]).astype(np.int64)
    ctx = np.array(lengths, np.int64)
    q = rng.standard_normal((qsl[-1], heads, d)).astype(np.float32) * 2
    s = rng.standard_normal(heads).astype(np.float32) * 3 if sinks else None
    want = ref.paged_attention(q, *floats, qsl, ctx, tables, 0.125, window, softcap, s)
    got = _run(q, caches, qsl, ctx, tables, window, softcap, s)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    np.testing.assert_array_equal(_run(q, caches, qsl, ctx, tables, window, softcap, s, threads=2), got)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16], ids=["f32", "f16"])
@pytest.mark.parametrize("heads,kvh,window", [(9, 3, 0), (14, 2, 100), (8, 1, 0), (3, 3, 37)])
def test_a_query_gives_the_same_bits_alone_in_a_chunk_and_in_a_batch(dtype, heads, kvh, window) -> None:
    """Query p of a sequence: decoded alone (context p + 1), as each row of prefill chunks that
    end at various places, and beside two other sequences; its output is the same bits each time."""
    d, bs, n = 64, 16, 3 * TILE + 21
    rng = np.random.default_rng(heads + window)
    caches, tables, _ = _pool(rng, [n, 50, 300], kvh, d, bs, dtype)
    q_all = rng.standard_normal((n, heads, d)).astype(np.float32)
    for p in (TILE - 1, TILE, 2 * TILE + 7, n - 1):
        alone = _run(q_all[p : p + 1], caches, np.array([0, 1]), np.array([p + 1]), tables[:1], window)[0]
        for first, last in ((p - 5, p), (p - 20, min(n - 1, p + 11)), (max(0, p - 70), min(n - 1, p + 3))):
            chunk = _run(q_all[first : last + 1], caches, np.array([0, last - first + 1]),
                         np.array([last + 1]), tables[:1], window)  # fmt: skip
            np.testing.assert_array_equal(chunk[p - first], alone, err_msg=f"p={p} chunk={first}..{last}")
        others = rng.standard_normal((39, heads, d)).astype(np.float32)
        q = np.concatenate([others[:7], q_all[p : p + 1], others[7:]])
        qsl, ctx = np.array([0, 7, 8, 40]), np.array([50, p + 1, 300])
        batch = _run(q, caches, qsl, ctx, tables[[1, 0, 2]], window, threads=2)
        np.testing.assert_array_equal(batch[7], alone)
