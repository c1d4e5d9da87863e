"""Attention's key pass over a q8_0 K cache, in llama.cpp's CPU flash-attention arithmetic.

Keys: each query row is quantized to Q8_0 once per step the way ggml's AVX2 quantize_row_q8_0 does
(d = max|x| / 127 stored as f16, quants rint(x * 127 / max|x|), ties to even), and a score is the sum
over 32-blocks of (d_key * d_query) * (int8 . int8 in int32), then times the softmax scale: the
integer dot of ggml_vec_dot_q8_0_q8_0 in its AVX2 lane order (simd_i8.q8_dot_row: vpmaddubsw here),
with no float copy of the key.
Values stay in attention._weighted_values: each q8_0 row is dequantized once (d * q, kv.py, a vector
convert per block) and added times w to every row of the group, as llama.cpp's v_to_float + mad.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kv import Q8_BYTES, Q8_VALUES
from .simd import HAVE_F16C, f16_to_f32, f32, f32_to_f16, i32, rint_f32
from .simd_i8 import HAVE_AVX2, q8_dot_row

SCALES_IN_IR = HAVE_AVX2 and HAVE_F16C  # q8_dot_row reads the key's f16 scales itself (no kd)


@njit(cache=True, error_model="numpy")
def quantize_query(x, qq, qd) -> None:
    """qq (D,) int8, qd (D / 32,) float32 = x (D,) as ggml's AVX2 quantize_row_q8_0 writes it: the
    f16-rounded scale and rint(x * (127 / max|x|)).  No fastmath: 127 / max is not 1 / d, on purpose."""
    for b in range(qd.shape[0]):
        o = b * Q8_VALUES
        amax = f32(0.0)
        for j in range(Q8_VALUES):
            amax = max(amax, abs(x[o + j]))
        qd[b] = f16_to_f32(f32_to_f16(amax / f32(127.0)))
        inv = f32(127.0) / amax if amax != f32(0.0) else f32(0.0)
        for j in range(Q8_VALUES):
            qq[o + j] = np.int8(i32(rint_f32(x[o + j] * inv)))


@njit(cache=True, fastmath=True, error_model="numpy")
def scores_q8(qq, qd, rows, keys, table, bs, kvh, kh, lo, hi, scale, softcap, sc, kd) -> None:
    """attention._scores for a q8_0 key cache: qq/qd hold each row's quantized query (unscaled; the
    score is scaled after the dot, as llama.cpp does).  kd (D / 32,): scratch for a key's scales."""
    first, end = lo[0], hi[rows - 1]
    width = keys.shape[1]
    for b in range(first // bs, (end - 1) // bs + 1):
        j0, j1 = max(first, b * bs), min(end, b * bs + bs)
        kr0 = (table[b] * bs - b * bs) * kvh + kh
        for j in range(j0, j1):
            kr = kr0 + j * kvh
            for c in range(0 if SCALES_IN_IR else kd.shape[0]):
                o = c * Q8_BYTES
                kd[c] = f16_to_f32((i32(keys[kr, o]) & 0xFF) | ((i32(keys[kr, o + 1]) & 0xFF) << 8))
            for row in range(rows):
                if j < lo[row] or j >= hi[row]:
                    continue
                s = q8_dot_row(keys, kr * width, kd, qq, row * qq.shape[1], qd, row * kd.shape[0]) * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                sc[row, j - lo[row]] = s
