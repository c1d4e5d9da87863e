"""NumPy twins of kernels/moe.py: routing and the mixture-of-experts FFN in plain float32."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .reference import geglu, rounded_activations, swiglu_oai

RENORM_MIN = np.float32(6.103515625e-5)


def route(logits: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids (T, k), weights (T, k)): softmax over all experts, the k most probable (ties: lower index),
    their probabilities renormalised to sum 1 if renorm (mixtral, qwen3moe) or as they are (qwen2moe)."""
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = (z / z.sum(axis=1, keepdims=True)).astype(np.float32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if renorm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), RENORM_MIN)
    return ids.astype(np.int64), w.astype(np.float32)


def moe_ffn(
    h: np.ndarray, router: np.ndarray, experts: Callable[[int], Sequence[np.ndarray]], k: int, renorm: bool,
    biases: Callable[[int], Sequence[np.ndarray]] | None = None, router_bias: np.ndarray | None = None,
    activation: str = "silu", router_in: np.ndarray | None = None, down_scale: np.ndarray | None = None,
    rounded: tuple[int, int] | None = None,
) -> np.ndarray:  # fmt: skip
    """sum over each token's routed experts of weight * down(act(gate(h), up(h))); router (E, dim)
    float, experts(e) -> (gate, up, down) float matrices of expert e (only routed ones are asked).
    gpt-oss: biases(e) -> expert e's (gate, up, down) output biases, router_bias (E,) added to the
    logits, activation "swiglu_oai" (reference.swiglu_oai) instead of SwiGLU. gemma4: activation
    "gelu_tanh" (GeGLU), the router reading router_in (T, dim) instead of h, and expert e's down
    output times down_scale[e]. rounded: the experts' (gate/up, down) GGML types, whose inputs are then
    rounded as the integer path rounds them (reference.rounded_activations)."""
    logits = (h if router_in is None else router_in) @ router.T
    ids, weights = route(logits if router_bias is None else logits + router_bias, k, renorm)
    out = np.zeros_like(h, dtype=np.float32)
    for e in np.unique(ids):
        gate, up, down = experts(int(e))
        bg, bu, bd = (np.float32(0),) * 3 if biases is None else biases(int(e))
        t, j = np.nonzero(ids == e)
        x = h[t] if rounded is None else rounded_activations(h[t], rounded[0])
        g, u = x @ gate.T + bg, x @ up.T + bu
        act = _activation(activation, g, u)
        act = act if rounded is None else rounded_activations(act, rounded[1])
        y = act @ down.T + bd
        y = y if down_scale is None else y * np.float32(down_scale[e])
        np.add.at(out, t, weights[t, j][:, None] * y)
    return out


def _activation(name: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if name == "swiglu_oai":
        return swiglu_oai(g, u)
    if name == "gelu_tanh":
        return geglu(g, u)
    return g / (np.float32(1.0) + np.exp(-g)) * u


def sigmoid_gate(h: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """(T, 1) sigmoid(h . weight)."""
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-(h @ weight)))).astype(np.float32)[:, None]
