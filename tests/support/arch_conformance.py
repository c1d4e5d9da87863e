"""Comparing localllm with llama.cpp's fixtures of tests/data/arch (see fixtures/make_arch_fixtures.py).

A fixture holds, for a prompt of token ids: llama.cpp's top-k logits at every prompt position, all logits
at the last one, its greedy continuation with each step's top-1/top-2 margin, and the calibration (how
far localllm's float32 NumPy oracle lands from llama.cpp on the same file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from paths import ARCH_DATA

DATA = ARCH_DATA


def load_fixture(variant: str) -> dict:
    return json.loads((DATA / f"{variant}.json").read_text())


def assert_fixture_file(path: Path, variant: str) -> dict:
    """`path` is the very file llama.cpp ran for `variant`'s fixture, and the fixture is peaky (most next
    tokens are clear, so agreement means something); returns the fixture."""
    ref = load_fixture(variant)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], "regenerate the fixtures"
    assert ref["calibration"]["median_margin"] > 3.0
    return ref


def engine(path: Path, backend: str = "numba", fuse: bool = True) -> Any:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    e = LLMEngine(EngineConfig(model=str(path), backend=backend, threads=2, ctx_size=128))
    if hasattr(e.backend, "fuse_layers"):
        e.backend.fuse_layers = fuse
    return e


def teacher_forced(path_or_engine: Any, ref: dict, backend: str = "numba") -> np.ndarray:
    """Logits at every position of prompt + greedy[:-1]: position P-1+g predicts greedy[g]."""
    from localllm.engine.engine import score_tokens

    e = path_or_engine if not isinstance(path_or_engine, Path) else engine(path_or_engine, backend)
    return np.asarray(score_tokens(e, ref["prompt"] + ref["greedy"][:-1]), np.float32)


def reference_choices(ref: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's (top-1 id, top-2 id, top-1 minus top-2 margin) at each teacher-forced position."""
    top = ref["prompt_top"][:-1]
    ids1 = [t[0][0] for t in top] + list(ref["greedy"])
    ids2 = [t[1][0] for t in top] + [-1] * len(ref["greedy"])
    margins = [t[0][1] - t[1][1] for t in top] + list(ref["greedy_margin"])
    return np.array(ids1), np.array(ids2), np.array(margins)


def compare(logits: np.ndarray, ref: dict, near: float) -> dict:
    """Figures of logits against llama.cpp's, and the problems where llama.cpp's margin exceeds `near`."""
    ids1, ids2, margins = reference_choices(ref)
    ours = logits.argmax(-1)
    clear = margins > near
    P = len(ref["prompt"])
    last, theirs = logits[P - 1], np.asarray(ref["last_logits"], np.float32)
    has2 = ids2 >= 0
    rows = np.nonzero(has2)[0]
    margin_err = logits[rows, ids1[has2]] - logits[rows, ids2[has2]] - margins[has2]
    figures = {
        "rms_last": float(np.sqrt(np.mean((last - theirs) ** 2))),
        "agree_all": float((ours == ids1).mean()),
        "agree_clear": float((ours[clear] == ids1[clear]).mean()) if clear.any() else 1.0,
        "margin_noise": float(np.abs(margin_err).max()),
        "top8_shared": len(set(np.argsort(-last)[:8]) & set(np.argsort(-theirs)[:8])),
        "median_margin": float(np.median(margins)),
    }
    problems = [f"position {i}: argmax {ours[i]} != {ids1[i]} (margin {margins[i]:.2f})"
                for i in np.nonzero(clear & (ours != ids1))[0]]  # fmt: skip
    return {"figures": figures, "problems": problems}


def near_tie(ref: dict) -> float:
    """The margin under which llama.cpp's choice is a near-tie: twice the calibrated margin noise."""
    return max(0.25, 2.0 * ref["calibration"]["margin_noise"])


def greedy(e: Any, ref: dict) -> list[int]:
    from localllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=len(ref["greedy"]), ignore_eos=True)
    return list(e.generate([list(ref["prompt"])], params)[0].token_ids)


def greedy_problem(ours: list[int], ref: dict) -> str | None:
    """Free-running greedy must equal llama.cpp's up to its first near-tie."""
    limit = near_tie(ref)
    for g, (a, b) in enumerate(zip(ours, ref["greedy"], strict=False)):
        if ref["greedy_margin"][g] <= limit:
            return None
        if a != b:
            return f"greedy step {g}: {a} != llama.cpp's {b} (margin {ref['greedy_margin'][g]:.2f})"
    return None


def rms_bound(ref: dict) -> float:
    """localllm's last-position logits may differ from llama.cpp's by the calibrated RMS, with room for
    its own 8-bit activation rounding (quantized files) and float reordering."""
    return 1.5 * ref["calibration"]["rms_last"] + 0.02


def router_logits(path: Path, ref: dict, rounded: bool) -> list[tuple[np.ndarray, int]]:
    """(router logits (positions, experts), experts used) of each mixture-of-experts layer, from the
    NumPy oracle teacher-forced over prompt + greedy; rounded: with the integer path's 8-bit rounding
    of every matmul input (NumpyBackend.round_activations)."""
    from localllm.backends.numpy_ref import NumpyBackend
    from localllm.kernels import moe_reference

    seen, route = [], moe_reference.route

    def recording(logits: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
        seen.append((np.array(logits, np.float32), k))
        return route(logits, k, renorm)

    moe_reference.route, NumpyBackend.round_activations = recording, rounded
    try:
        teacher_forced(path, ref, "numpy")
    finally:
        moe_reference.route, NumpyBackend.round_activations = route, False
    return seen


def routing_near_tie(path: Path, ref: dict) -> bool:
    """Whether the last prompt position routes on a near-tie: in some layer the oracle's k-th and
    (k+1)-th router logits there are closer than twice the most that 8-bit activation rounding moves
    that layer's router logits (the oracle with and without it, over all positions). Which expert
    llama.cpp picks there is then chance, and so are the last-position logits (not their argmax: the
    usual near-tie rule covers that)."""
    plain, rounded = router_logits(path, ref, False), router_logits(path, ref, True)
    assert len(plain) == len(rounded) and all(a[0].shape[0] == len(ref["prompt"]) + len(ref["greedy"]) - 1
                                              for a in plain), "one pass per layer expected"  # fmt: skip
    last = len(ref["prompt"]) - 1
    for (a, k), (b, _) in zip(plain, rounded, strict=True):
        noise = float(np.abs(a - b).max())
        top = np.sort(a[last])[::-1]
        if top[k - 1] - top[k] < 2.0 * noise:
            return True
    return False


def failures(logits: np.ndarray, ref: dict, routing_tie: bool = False) -> list[str]:
    """What breaks the fixture rules; routing_tie (routing_near_tie) lifts the last-position RMS bound."""
    result = compare(logits, ref, near_tie(ref))
    out = list(result["problems"])
    fig = result["figures"]
    if fig["rms_last"] > rms_bound(ref) and not routing_tie:
        out.append(f"last-position logits RMS {fig['rms_last']:.4f} > {rms_bound(ref):.4f}")
    if fig["top8_shared"] < 6:
        out.append(f"only {fig['top8_shared']} of llama.cpp's top 8 shared")
    return out
