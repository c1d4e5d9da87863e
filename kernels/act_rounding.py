"""How the integer path rounds a matmul's input to 8 bits: as llama.cpp's CPU back end does before a
weight of the same type (its `vec_dot_type`), so that near-tied logits fall on llama.cpp's side.

  ROUND_Q8_0  per 32 values: x8 = rint(x * (127 / max|x|)), scale max|x| / 127 rounded to float16
  ROUND_Q8_1  the same, with each block's sum term (scale * sum(x8)) taken as float16(max|x| / 127 *
              sum(x8)), as ggml stores it for Q4_1 / Q5_1 weights' minimum terms
  ROUND_Q8_K  per 256 values: s = 127 / max|x|, x8 = rint(x * s), scale 1 / s in float32
"""

from __future__ import annotations

ROUND_NONE, ROUND_Q8_0, ROUND_Q8_K, ROUND_Q8_1 = 0, 1, 2, 3

# GGML type ids -> rounding (the types the integer path multiplies; others take the float path)
BY_GGML_TYPE = {2: ROUND_Q8_0, 3: ROUND_Q8_1, 6: ROUND_Q8_0, 7: ROUND_Q8_1, 8: ROUND_Q8_0, 39: ROUND_Q8_0}
BY_GGML_TYPE |= {12: ROUND_Q8_K, 13: ROUND_Q8_K, 14: ROUND_Q8_K}
