"""How many tokens each sequence drafts: its recent acceptance rate against the measured cost of drafting.

A verify step of k drafts kept each with probability alpha emits E(k) = (1 - alpha^(k+1)) / (1 - alpha)
tokens instead of one. It costs the extra step time of k more query rows (the slope of step time in tokens,
measured on this machine's own steps) plus the draft's own time per drafted token. A sequence drafts the k
that maximises E(k) - 1 - k * cost, where cost is that extra time in units of tokens the batch would have
produced meanwhile; no k when no gain is positive (speculation off), with a probe of one draft now and
then (exponentially rarer while it keeps failing) so a sequence that starts copying is noticed. Now and
then a whole step runs without drafts, to keep the plain step time measured.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 2.0  # a new sequence's acceptance rate, as if from 2 drafted tokens
DECAY = 0.7  # weight of the past in a sequence's acceptance counts, per verify step
PROBE_FIRST, PROBE_MAX = 8, 64  # steps a sequence with speculation off waits before one probe draft
EXPLORE_EVERY = 32  # decode steps between plain steps that re-measure the step time without drafts
EMA = 0.2  # weight of a new measurement in a step time
DEFAULT_SLOPE = 0.05  # step time per extra token, as a fraction of a step, before any is measured


@dataclass(slots=True)
class SeqSpecState:
    drafted: float = PRIOR_WEIGHT  # decayed count of drafted tokens (prior included)
    accepted: float = PRIOR_WEIGHT * PRIOR_ALPHA
    idle: int = 0  # steps since the last draft while speculation is off
    probe_every: int = PROBE_FIRST

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens one verify step of k drafts emits when each draft is kept with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, cost: float, k_max: int) -> int:
    """The draft length with the largest positive net gain E(k) - 1 - k * cost; 0 when none pays."""
    best, gain = 0, 0.0
    for k in range(1, k_max + 1):
        g = expected_tokens(k, alpha) - 1.0 - k * cost
        if g > gain:
            best, gain = k, g
    return best


class StepCosts:
    """Step seconds by query tokens in the step (decode and verify steps only: prefill chunks would
    swamp them), and draft seconds per drafted token; exponential moving averages."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.draft_per_token = 0.0
        self._seen: set[int] = set()

    def record(self, num_tokens: int, seconds: float, draft_per_token: float | None = None) -> None:
        """A step of num_tokens query tokens took `seconds` in the target; drafting, where measured,
        cost draft_per_token seconds per drafted token (prompt lookup: none to speak of)."""
        if draft_per_token is not None:
            old_per = self.draft_per_token
            self.draft_per_token = (
                draft_per_token if not old_per else (1 - EMA) * old_per + EMA * draft_per_token
            )
        if num_tokens not in self._seen:  # a size's first step may load or compile kernels: not a cost
            self._seen.add(num_tokens)
            return
        old = self.times.get(num_tokens)
        self.times[num_tokens] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def step_time(self, num_tokens: int) -> float | None:
        """The measured time of a step of num_tokens, interpolated between measured sizes."""
        if num_tokens in self.times:
            return self.times[num_tokens]
        if not self.times:
            return None
        slope = self.slope(num_tokens, num_tokens)
        nearest = min(self.times, key=lambda t: abs(t - num_tokens))
        return max(self.times[nearest] + slope * (num_tokens - nearest), 1e-6)

    def slope(self, low: int, high: int) -> float:
        """Seconds per extra token around [low, high]: a least-squares line through the measured sizes
        there (all of them when fewer than two are), DEFAULT_SLOPE of a step when only one is known."""
        near = [t for t in self.times if low // 2 <= t <= 2 * high + 1]
        points = near if len(near) >= 2 else list(self.times)
        if len(points) < 2:
            return DEFAULT_SLOPE * self.times[points[0]] if points else 0.0
        mean_t = sum(points) / len(points)
        mean_y = sum(self.times[t] for t in points) / len(points)
        var = sum((t - mean_t) ** 2 for t in points)
        cov = sum((t - mean_t) * (self.times[t] - mean_y) for t in points)
        return max(cov / var, 0.0)


class SpecPolicy:
    def __init__(self, k_max: int):
        self.k_max = k_max
        self.costs = StepCosts()
        self.states: dict[str, SeqSpecState] = {}
        self.steps = 0

    def token_cost(self, num_tokens: int, num_decodes: int) -> float:
        """One drafted token's extra time, in tokens the step's decodes would yield meanwhile."""
        base = self.costs.step_time(num_tokens)
        if base is None:
            return DEFAULT_SLOPE * num_decodes
        extra = self.costs.slope(num_tokens, num_tokens + self.k_max * num_decodes)
        return (extra + self.costs.draft_per_token) * num_decodes / base

    def lengths(self, request_ids: list[str], num_tokens: int) -> list[int]:
        """The draft length of each decoding sequence this step (num_tokens: the step's plain tokens)."""
        self.steps += 1
        if self.steps % EXPLORE_EVERY == 0:
            return [0] * len(request_ids)
        cost = self.token_cost(num_tokens, len(request_ids))
        return [self._length(self.states.setdefault(r, SeqSpecState()), cost) for r in request_ids]

    def _length(self, state: SeqSpecState, cost: float) -> int:
        k = best_length(state.alpha, cost, self.k_max)
        if k:
            state.idle, state.probe_every = 0, PROBE_FIRST
            return k
        state.idle += 1
        if state.idle < state.probe_every:
            return 0
        state.idle, state.probe_every = 0, min(2 * state.probe_every, PROBE_MAX)
        return 1

    def record_verify(self, request_id: str, drafted: int, accepted: int) -> None:
        self.states.setdefault(request_id, SeqSpecState()).record(drafted, accepted)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
