"""kernels/gated_delta.py against its NumPy twins: the conv with its rolling window, the delta rule
(recurrent and chunkwise forms), and the whole mixer over a batch of sequences at mixed positions."""

from __future__ import annotations

import numpy as np
import pytest

from localllm.kernels import gated_delta as gd
from localllm.kernels import gated_delta_reference as twin

N_K, N_V, D, TAPS = 2, 4, 16, 4
C = (2 * N_K + N_V) * D


def _inputs(rng, t: int):
    qkv = rng.standard_normal((t, C)).astype(np.float32)
    z = rng.standard_normal((t, N_V * D)).astype(np.float32)
    beta, alpha = (rng.standard_normal((t, N_V)).astype(np.float32) for _ in range(2))
    return qkv, z, beta, alpha


def _layer(rng):
    conv = (rng.standard_normal((C, TAPS)) * 0.5).astype(np.float32)
    dt = rng.uniform(-1, 1, N_V).astype(np.float32)
    a = -np.exp(rng.uniform(-1.5, 1.0, N_V)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return conv, dt, a, norm


def _run_numba(layer, inputs, qsl, pos, slots, conv_state, ssm_state, interleaved, nth):
    conv, dt, a, norm = layer
    qkv, z, beta, alpha = inputs
    out = np.empty(z.shape, np.float32)
    gd.mixer_core(qkv, z, beta, alpha, np.ascontiguousarray(conv.T), dt, a, norm, qsl, pos, slots, conv_state,
                  ssm_state, N_K, D, interleaved, 1e-6, np.empty_like(qkv), out, nth)  # fmt: skip
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nth", [1, 2])
def test_mixer_matches_its_twin_on_a_mixed_batch(interleaved: bool, nth: int) -> None:
    """Three sequences: a fresh 70-token prefill (past a 64-token chunk), a chunk continuing at position
    9, and a one-token decode, in slots 2, 0, 1; both paths start from the same states."""
    rng = np.random.default_rng(1)
    layer = _layer(rng)
    counts = [70, 5, 1]
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pos = np.concatenate([np.arange(70), np.arange(9, 14), [30]]).astype(np.int64)
    slots = np.array([2, 0, 1], np.int64)
    inputs = _inputs(rng, qsl[-1])
    conv0 = rng.standard_normal((3, TAPS - 1, C)).astype(np.float32)
    ssm0 = (rng.standard_normal((3, N_V, D, D)) * 0.3).astype(np.float32)
    conv_n, ssm_n, conv_t, ssm_t = conv0.copy(), ssm0.copy(), conv0.copy(), ssm0.copy()
    out = _run_numba(layer, inputs, qsl, pos, slots, conv_n, ssm_n, interleaved, nth)
    conv, dt, a, norm = layer
    expected = twin.mixer(*inputs, conv, dt, a, norm, qsl, pos, slots, conv_t, ssm_t, N_K, interleaved, 1e-6)
    np.testing.assert_allclose(out, expected, atol=2e-4, rtol=1e-3)
    np.testing.assert_allclose(ssm_n, ssm_t, atol=2e-4)
    np.testing.assert_array_equal(conv_n, conv_t)


def test_a_prefill_in_chunks_equals_one_prefill() -> None:
    """Chunked prefill: the state carried between chunks gives the one-pass outputs, to rounding."""
    rng = np.random.default_rng(2)
    layer, inputs = _layer(rng), _inputs(rng, 23)
    zeros = np.zeros((1, TAPS - 1, C), np.float32), np.zeros((1, N_V, D, D), np.float32)
    whole = _run_numba(layer, inputs, np.array([0, 23]), np.arange(23), np.array([0]), *zeros, False, 1)
    conv, ssm = np.full((1, TAPS - 1, C), 9.0, np.float32), np.full((1, N_V, D, D), 9.0, np.float32)
    parts = []
    for lo, hi in ((0, 10), (10, 11), (11, 23)):  # garbage in the slot: position 0 starts from zeros
        piece = tuple(x[lo:hi] for x in inputs)
        parts.append(_run_numba(layer, piece, np.array([0, hi - lo]), np.arange(lo, hi), np.array([0]),
                                conv, ssm, False, 1))  # fmt: skip
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5, rtol=1e-5)


def test_chunkwise_form_equals_the_recurrence() -> None:
    rng = np.random.default_rng(3)
    T, H = 150, 3
    q, k = (twin.l2_norm(rng.standard_normal((T, H, D)).astype(np.float32), 1e-6) for _ in range(2))
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, H)).astype(np.float32)
    g = -rng.uniform(0, 2, (T, H)).astype(np.float32)
    s0 = rng.standard_normal((H, D, D)).astype(np.float32)
    o1, s1 = twin.delta_rule(q, k, v, g, beta, s0)
    o2, s2 = twin.delta_rule_chunked(q, k, v, g, beta, s0, chunk=64)
    np.testing.assert_allclose(o2, o1, atol=1e-4)
    np.testing.assert_allclose(s2, s1, atol=1e-4)


def test_conv_window_rolls_over_steps() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, C)).astype(np.float32)
    w = rng.standard_normal((C, TAPS)).astype(np.float32)
    whole, state = twin.conv_silu(x, w, None)
    out_a, st = twin.conv_silu(x[:5], w, None)
    out_b, st = twin.conv_silu(x[5:], w, st)
    np.testing.assert_allclose(np.concatenate([out_a, out_b]), whole, rtol=1e-6)
    np.testing.assert_array_equal(st, x[-(TAPS - 1) :])
    out = np.empty_like(x)
    cs = np.zeros((1, TAPS - 1, C), np.float32)
    gd.conv_silu(x, np.ascontiguousarray(w.T), np.array([0, 7]), np.arange(7), np.array([0]), cs, out)
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cs[0], state)


def test_conv_split_over_threads_equals_one_pass() -> None:
    """conv_silu_par (a prefill's conv, channels split over threads; a width no multiple of 16) gives
    conv_silu's outputs and windows bit for bit, over sequences that start, continue, or add fewer
    tokens than the window holds."""
    rng = np.random.default_rng(5)
    width = 330
    x = rng.standard_normal((9, width)).astype(np.float32)
    wt = rng.standard_normal((TAPS, width)).astype(np.float32)
    qsl, pos, slots = np.array([0, 5, 5, 7, 9]), np.array([0, 1, 2, 3, 4, 8, 9, 3, 4]), np.array([2, 0, 1, 3])
    state = rng.standard_normal((4, TAPS - 1, width)).astype(np.float32)
    (s1, o1), (s2, o2) = ((state.copy(), np.empty_like(x)) for _ in range(2))
    gd.conv_silu(x, wt, qsl, pos, slots, s1, o1)
    gd.conv_silu_par(x, wt, qsl, pos, slots, s2, o2, 3)
    np.testing.assert_array_equal(o2, o1)
    np.testing.assert_array_equal(s2, s1)
    assert not np.array_equal(s1[1], state[1])  # the 2-token sequence rolled its window on
