"""Decode-shaped paged attention over an f32, f16 and q8_0 cache: best of 200 alternating calls each.

python scripts/bench_kv_attention.py
"""

import time

import numpy as np

from localllm.kernels import attention, layers

rng = np.random.default_rng(0)
for H, KVH, D, ctx in [(9, 3, 64, 1024), (14, 2, 64, 4096)]:
    bs = 16
    nb = ctx // bs
    k, v = rng.standard_normal((2, ctx, KVH, D)).astype(np.float32)
    slots = np.arange(ctx, dtype=np.int64)
    pools = {}
    for name, dt, w in (("f32", np.float32, D), ("f16", np.uint16, D), ("q8_0", np.int8, D // 32 * 34)):
        kc, vc = np.zeros((nb, bs, KVH, w), dt), np.zeros((nb, bs, KVH, w), dt)
        layers.store_kv_rows(kc, vc, k, v, slots)
        pools[name] = (kc, vc)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    qsl, c = np.array([0, 1], np.int64), np.array([ctx], np.int64)
    tables = np.arange(nb, dtype=np.int64)[None]
    out = np.empty_like(q)
    best = {n: 1e9 for n in pools}
    for _ in range(200):
        for n, (kc, vc) in pools.items():
            t = time.perf_counter()
            attention.paged_attention_serial(q, kc, vc, qsl, c, tables, 0.125, 0, 0.0, out)
            best[n] = min(best[n], time.perf_counter() - t)
    print(
        f"H={H} KVH={KVH} D={D} ctx={ctx}: " + ", ".join(f"{n} {b * 1e6:.0f} us" for n, b in best.items()),
        f"q8/f16 = {best['q8_0'] / best['f16']:.2f}",
        flush=True,
    )
