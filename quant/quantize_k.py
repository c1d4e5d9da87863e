"""NumPy quantizer for ggml's Q6_K (256-element super-blocks of 16 sub-blocks with int8 scales).

It reproduces ggml's reference `quantize_row_q6_K_ref` (what llama-quantize writes without an importance
matrix): per sub-block, `make_qx_quants` tries 19 scales and keeps the one with the smallest weighted
error (weights x^2), then the sub-block scales are themselves quantized to int8 against one fp16 scale
and the values re-rounded with the final scales.  Sums are accumulated sequentially in float32
(cumsum), as the C loops do, and nearest_int is round-half-to-even (np.rint), as its magic-number trick.
"""

from __future__ import annotations

import numpy as np

from .ggml import BLOCK_Q6_K

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    index = np.abs(x).argmax(axis=-1)
    return np.take_along_axis(x, index[:, None], axis=-1)[:, 0]


def _trial(x: np.ndarray, iscale: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels for one candidate scale, and the weighted sums sum(w x l), sum(w l^2) in C's order."""
    levels = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1).astype(F32)
    w = x * x
    sumlx = np.cumsum(w * x * levels, axis=1, dtype=F32)[:, -1]
    suml2 = np.cumsum(w * levels * levels, axis=1, dtype=F32)[:, -1]
    return levels, sumlx, suml2


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x (m, n) -> (scale per row, levels + nmax per row); ggml's rmse_type 1 without weights."""
    top = _signed_absmax(x)
    zero = np.abs(top) < GROUP_MAX_EPS
    top = np.where(zero, F32(1), top)
    levels, sumlx, suml2 = _trial(x, F32(-nmax) / top, nmax)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        candidate, lx, l2 = _trial(x, -(F32(nmax) + F32(0.1) * F32(step)) / top, nmax)
        better = (l2 > 0) & (lx * lx > best * l2)
        levels = np.where(better[:, None], candidate, levels)
        scale = np.where(better, lx / np.where(better, l2, F32(1)), scale)
        best = np.where(better, scale * lx, best)
    out = (levels + nmax).astype(np.int8)
    out[zero] = 0
    return np.where(zero, F32(0), scale).astype(F32), out


def _pack_q6(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 256) 6-bit levels -> ql (n, 128) low nibbles and qh (n, 64) high crumbs, in ggml's order."""
    q = levels.astype(np.uint8).reshape(-1, 2, 4, 32)  # two halves of 128, four quarters of 32
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 super-blocks (n, 256) -> Q6_K blocks, bit-exact with ggml's reference."""
    n = len(x)
    sub = x.reshape(n * 16, 16)
    scales, levels = make_qx_quants(sub, 32)
    scales, levels = scales.reshape(n, 16), levels.reshape(n, 16, 16)
    max_scale = _signed_absmax(scales)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d = (F32(1) / iscale).astype(np.float16)
    sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    sub_d = d.astype(F32)[:, None] * sc.astype(F32)  # (n, 16)
    safe = np.where(sub_d == 0, F32(1), sub_d)
    fresh = np.clip(np.rint(x.reshape(n, 16, 16) / safe[:, :, None]), -32, 31) + 32
    levels = np.where((sub_d == 0)[:, :, None], levels, fresh.astype(np.int8))
    ql, qh = _pack_q6(levels.reshape(n, 256))
    out = np.zeros(n, dtype=BLOCK_Q6_K)
    out["ql"], out["qh"], out["scales"], out["d"] = ql, qh, sc, d
    out[zero] = np.zeros(1, dtype=BLOCK_Q6_K)
    return out


QUANTIZERS = {"Q6_K": quantize_q6_k}
