"""NumPy quantizers for ggml's k-quants Q4_K, Q5_K (8 sub-blocks of 32 with 6-bit scales and mins) and
Q6_K (16 sub-blocks of 16 with int8 scales), in 256-element super-blocks.

Q4_K/Q5_K reproduce `quantize_row_q4_K_ref`/`_q5_K_ref`: per sub-block `make_qkx2_quants` searches a
scale and a min minimising the error weighted by (rms + |x|), then both are quantized to 6 bits.
Q6_K reproduces ggml's reference `quantize_row_q6_K_ref` (what llama-quantize writes without an importance
matrix): per sub-block, `make_qx_quants` tries 19 scales and keeps the one with the smallest weighted
error (weights x^2), then the sub-block scales are themselves quantized to int8 against one fp16 scale
and the values re-rounded with the final scales.  Sums are accumulated sequentially in float32
(cumsum), as the C loops do, and nearest_int is round-half-to-even (np.rint), as its magic-number trick.
"""

from __future__ import annotations

import numpy as np

from .ggml import BLOCK_Q4_K, BLOCK_Q5_K, BLOCK_Q6_K

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


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Row sums accumulated left to right in float32, as a C loop does."""
    return np.cumsum(v, axis=1, dtype=F32)[:, -1]


def _levels(x: np.ndarray, low: np.ndarray, iscale: np.ndarray, nmax: int) -> np.ndarray:
    return np.clip(np.rint(iscale[:, None] * (x - low[:, None])), 0, nmax).astype(F32)


def _weighted_error(x, w, scale, low, levels) -> np.ndarray:  # type: ignore[no-untyped-def]
    diff = scale[:, None] * levels + low[:, None] - x
    return _seq_sum(w * (diff * diff))


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (m, n) -> (scale, -min, levels): ggml's make_qkx2_quants with rdelta 0.1, squared error."""
    low, high = np.minimum(x.min(axis=1), F32(0)), x.max(axis=1)
    flat = high == low
    span = np.where(flat, F32(1), high - low)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    levels = _levels(x, low, iscale, nmax)
    best = _weighted_error(x, w, scale, low, levels)
    for step in range(nstep + 1):
        span = np.where(flat, F32(1), high - low)  # as in C, a min adopted below moves the next scales
        iscale = (F32(rmin) + F32(0.1) * F32(step) + F32(nmax)) / span
        cand = _levels(x, low, iscale, nmax)
        sum_l, sum_l2, sum_xl = _seq_sum(w * cand), _seq_sum(w * cand * cand), _seq_sum(w * cand * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = np.where(det > 0, det, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / np.where(sum_l2 != 0, sum_l2, F32(1)), this_scale)
        error = _weighted_error(x, w, this_scale, this_min, cand)
        better = (det > 0) & (error < best)
        levels = np.where(better[:, None], cand, levels)
        best, scale = np.where(better, error, best), np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    scale = np.where(flat, F32(0), scale).astype(F32)
    levels[flat] = 0
    return scale, (-low).astype(F32), levels


def _six_bits(v: np.ndarray, top: np.ndarray) -> np.ndarray:
    """nearest_int(63/top * v) stored in a uint8_t, capped at 63 (0 where top <= 0)."""
    inv = np.where(top > 0, F32(63) / np.where(top > 0, top, F32(1)), F32(0))
    return np.minimum(np.rint(inv[:, None] * v).astype(np.int64) & 0xFF, 63).astype(np.uint8)


def _pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> ggml's 12-byte packing (get_scale_min_k4's inverse)."""
    out = np.zeros((len(ls), 12), np.uint8)
    out[:, :4], out[:, 4:8] = ls[:, :4], lm[:, :4]
    out[:, 8:] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    out[:, :4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _qkx_blocks(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Super-blocks (n, 256) -> (d, dmin, packed scales, levels (n, 8, 32)) shared by Q4_K and Q5_K."""
    n = len(x)
    sub = x.reshape(n * 8, 32)
    av = np.sqrt(_seq_sum(sub * sub) / F32(32))
    scales, mins, levels = make_qkx2_quants(sub, av[:, None] + np.abs(sub), nmax, rmin, nstep)
    scales, mins, levels = scales.reshape(n, 8), mins.reshape(n, 8), levels.reshape(n, 8, 32)
    max_scale, max_min = np.maximum(scales.max(axis=1), F32(0)), np.maximum(mins.max(axis=1), F32(0))
    ls, lm = _six_bits(scales, max_scale), _six_bits(mins, max_min)
    d, dmin = (max_scale / F32(63)).astype(np.float16), (max_min / F32(63)).astype(np.float16)
    sub_d = d.astype(F32)[:, None] * ls.astype(F32)
    dm = dmin.astype(F32)[:, None] * lm.astype(F32)
    safe = np.where(sub_d == 0, F32(1), sub_d)
    fresh = np.clip(np.rint((x.reshape(n, 8, 32) + dm[:, :, None]) / safe[:, :, None]), 0, nmax)
    levels = np.where((sub_d == 0)[:, :, None], levels, fresh).astype(np.uint8)
    return d, dmin, _pack_scales(ls, lm), levels


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 super-blocks (n, 256) -> Q4_K blocks, bit-exact with ggml's reference."""
    d, dmin, scales, levels = _qkx_blocks(x, 15, -1.0, 20)
    pairs = levels.reshape(len(x), 4, 2, 32)  # 64 values per 32 bytes: low nibbles, then high
    out = np.zeros(len(x), dtype=BLOCK_Q4_K)
    out["d"], out["dmin"], out["scales"] = d, dmin, scales
    out["qs"] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(len(x), 128)
    return out


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 super-blocks (n, 256) -> Q5_K blocks, bit-exact with ggml's reference."""
    d, dmin, scales, levels = _qkx_blocks(x, 31, -0.5, 15)
    pairs = levels.reshape(len(x), 4, 2, 32)
    low = pairs & 0x0F
    bits = (pairs >> 4).astype(np.uint8)  # fifth bits: pair p, half h -> bit 2p + h of qh[j]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    out = np.zeros(len(x), dtype=BLOCK_Q5_K)
    out["d"], out["dmin"], out["scales"] = d, dmin, scales
    out["qs"] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(len(x), 128)
    out["qh"] = np.bitwise_or.reduce(bits << shifts[None, :, :, None], axis=(1, 2))
    return out


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
