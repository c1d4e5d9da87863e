"""KL divergence of a model's next-token distributions from a base model's, as llama-perplexity's
`--kl-divergence` computes it: per scored position KL(base || model) over the base's log-probabilities
within 16 nats of its top one, the two perplexities and their difference with the covariance-aware
error, the change in the probability of the right token (Δp), and how often both put the same token
first ("same top p")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localllm.logits_file import dequantize_log_probs


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's: the mean, and its standard error when there are more than 10 values (else 0)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def covariance(sum_a: float, sum_b: float, sum_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear interpolation between the sorted values around fraction * (n - 1)."""
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    j = min(i + 1, len(sorted_values) - 1)
    return float((1 - (p - i)) * sorted_values[i] + (p - i) * sorted_values[j])


@dataclass(slots=True)
class KLDStats:
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    count: int = 0
    same_top: int = 0
    klds: list[np.ndarray] = field(default_factory=list)
    p_diffs: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """One chunk: the model's logits and the base's stored rows at the scored positions."""
        logits = np.asarray(logits, dtype=np.float32)
        targets = np.asarray(targets, dtype=np.int64)
        rows = np.arange(len(targets))
        top = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
        log_p = logits - (top + lse)
        base = dequantize_log_probs(base_rows, logits.shape[1])
        nll, nll_base = -log_p[rows, targets].astype(np.float64), -base[rows, targets].astype(np.float64)
        kept = base > -16.0
        terms = np.where(kept, np.exp(np.where(kept, base, 0)) * (base - log_p), 0.0)
        kld = terms.sum(axis=1, dtype=np.float64)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        for name, values in zip(_SUMS, _moments(nll, nll_base, kld, p_diff), strict=True):
            self.sums[name] += float(values.sum())
        self.count += len(targets)
        self.same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.klds.append(kld.astype(np.float32))
        self.p_diffs.append(p_diff.astype(np.float32))

    def mean(self, name: str) -> tuple[float, float]:
        squares = {"nll": "nll2", "nll_base": "nll_base2", "kld": "kld2", "p_diff": "p_diff2"}
        squares["p_diff2"] = "p_diff4"
        return mean_and_uncertainty(self.sums[name], self.sums[squares[name]], self.count)

    @property
    def ppl(self) -> float:
        return math.exp(self.mean("nll")[0]) if self.count else math.nan

    @property
    def ppl_stderr(self) -> float:
        return self.ppl * self.mean("nll")[1]

    @property
    def kld(self) -> float:
        return self.mean("kld")[0]

    def summary(self) -> dict[str, Any]:
        """The figures llama-perplexity prints at the end of a --kl-divergence run."""
        s = self.sums
        log_ppl, log_base = self.mean("nll"), self.mean("nll_base")
        cov = covariance(s["nll"], s["nll_base"], s["nll_nll_base"], self.count)
        ratio = log_ppl[0] - log_base[0]
        ratio_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov, 0.0))
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        diff_unc = math.sqrt(max(ppl_unc**2 + base_unc**2 - 2 * ppl * ppl_base * cov, 0.0))
        klds = np.sort(np.concatenate(self.klds)) if self.klds else np.zeros(1)
        mse = self.mean("p_diff2")
        rms = math.sqrt(mse[0])
        same = self.same_top / self.count if self.count else math.nan
        return {
            "ppl": ppl, "ppl_stderr": ppl_unc, "ppl_base": ppl_base, "ppl_base_stderr": base_unc,
            "ln_ppl_ratio": ratio, "ln_ppl_ratio_stderr": ratio_unc,
            "ppl_diff": ppl - ppl_base, "ppl_diff_stderr": diff_unc,
            "kld_mean": self.mean("kld")[0], "kld_stderr": self.mean("kld")[1],
            "kld_max": float(klds[-1]),
            "kld_p99_9": percentile(klds, 0.999), "kld_p99": percentile(klds, 0.99),
            "kld_p95": percentile(klds, 0.95), "kld_median": float(np.median(klds)),
            "kld_min": float(klds[0]),
            "p_diff_mean": self.mean("p_diff")[0], "p_diff_rms": rms,
            "p_diff_rms_stderr": 0.5 / rms * mse[1] if rms > 0 else 0.0,
            "same_top_p": same, "same_top_p_stderr": math.sqrt(same * (1 - same) / max(self.count - 1, 1)),
            "count": self.count,
        }  # fmt: skip


_SUMS = ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base")
_SUMS += ("kld", "kld2", "p_diff", "p_diff2", "p_diff4")


def _moments(nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray) -> tuple:
    p2 = p_diff * p_diff
    return (nll, nll * nll, nll_base, nll_base**2, nll * nll_base, kld, kld * kld, p_diff, p2, p2 * p2)
