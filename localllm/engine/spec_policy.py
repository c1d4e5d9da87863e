"""How many tokens each sequence drafts: its recent acceptance rate against the measured cost of drafting,
and a gate on the measured speed of the steps themselves, so that speculation is never a net slowdown.

A verify step of k drafts kept each with probability alpha emits E(k) = (1 - alpha^(k+1)) / (1 - alpha)
tokens instead of one. It costs k more query rows (the slope of step time in tokens, measured on this
machine's own steps) plus the drafting itself (its whole measured time per drafted token, a draft model's
catch-up passes included). In units of the sequence's share of a plain step, that is 1 + k * cost; a
sequence drafts the k that maximises E(k) / (1 + k * cost), and none unless that ratio clears MIN_GAIN
(speculation off). Prompt lookup probes an off sequence with one draft now and then (exponentially rarer
while it keeps failing); a draft model does not (its K/V would first have to catch up on every token since
it last drafted, which costs about a tenth of a target step per token). A new sequence starts from the
acceptance rate of the sequences before it, and every NEW_SEQ_PROBE-th one that would start off starts
hopeful instead, so a workload that begins to pay is noticed.

The gate checks the model against what it buys: per number of decoding sequences, the seconds per emitted
token of steps with drafts against plain steps (every EXPLORE_EVERY-th step is plain, to keep that
measured, and the step after GATE_FRESH drafted ones too, so the two are compared under the same load). When
the drafted steps are not MIN_GAIN faster, drafting stops for that batch width for a while (doubling while
it keeps losing). At a wide batch each verify row costs nearly a whole decode row, and there the
gate is what turns speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 2.0  # a first sequence's acceptance rate, as if from 2 drafted tokens
DECAY = 0.7  # weight of the past in a sequence's acceptance counts, per verify step
SEEN_DECAY = 0.95  # the same across all sequences, per verify step: a new sequence's prior
NEW_SEQ_PROBE = 8  # every 8th new sequence that would start off starts from PRIOR_ALPHA instead
MIN_GAIN = 0.05  # a predicted speed-up below 5% is within measurement noise: not worth a draft
PROBE_FIRST, PROBE_MAX = 8, 64  # steps an off sequence waits before one probe draft (prompt lookup)
EXPLORE_EVERY = 32  # decode steps between plain steps that re-measure the step time without drafts
EMA = 0.2  # weight of a new measurement in a step time
DEFAULT_SLOPE = 0.05  # step time per extra token, as a fraction of a step, before any is measured
GATE_EMA = 0.3  # weight of a new step in the gate's seconds per token
GATE_MIN_STEPS = 3  # drafted steps measured before the gate judges them
GATE_BACKOFF_FIRST, GATE_BACKOFF_MAX = 16, 512  # steps a closed gate stays closed
GATE_FRESH = 16  # drafted steps after which the next step is plain: load drifts, the comparison must not


@dataclass(slots=True)
class SeqSpecState:
    drafted: float = PRIOR_WEIGHT  # decayed count of drafted tokens (prior included)
    accepted: float = PRIOR_WEIGHT * PRIOR_ALPHA
    idle: int = 0  # steps since the last draft while speculation is off
    probe_every: int = PROBE_FIRST

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted

    def record(self, drafted: int, accepted: int, decay: float = DECAY) -> None:
        self.drafted = decay * self.drafted + drafted
        self.accepted = decay * self.accepted + accepted


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens one verify step of k drafts emits when each draft is kept with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, cost: float, k_max: int) -> int:
    """The draft length with the best speed-up E(k) / (1 + k * cost), a draft costing `cost` plain
    tokens; 0 when none beats plain decoding by MIN_GAIN."""
    best, ratio = 0, 1.0 + MIN_GAIN
    for k in range(1, k_max + 1):
        r = expected_tokens(k, alpha) / (1.0 + k * cost)
        if r > ratio:
            best, ratio = k, r
    return best


class StepCosts:
    """Step seconds by query tokens in the step (decode and verify steps only: prefill chunks would
    swamp them), and drafting seconds per drafted token; exponential moving averages."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.draft_per_token = 0.0
        self._seen: set[int] = set()

    def record(self, num_tokens: int, seconds: float, draft_per_token: float | None = None) -> None:
        """A step of num_tokens query tokens took `seconds` in the target; drafting, where there was
        some, cost draft_per_token seconds per drafted token (all of its time: catch-up included)."""
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


@dataclass(slots=True)
class _Rates:
    plain: float = 0.0  # seconds per emitted token of plain steps (0: not measured yet)
    drafted: float = 0.0  # the same for steps with drafts
    drafted_steps: int = 0  # drafted steps measured since the gate last judged
    since_plain: int = 0  # drafted steps since the last plain one
    closed_for: int = 0  # steps left with drafting off
    backoff: int = GATE_BACKOFF_FIRST


class SpeedGate:
    """Per number of decoding sequences: are steps with drafts faster per emitted token than plain ones?"""

    def __init__(self) -> None:
        self.rates: dict[int, _Rates] = {}

    def is_open(self, num_decodes: int) -> bool:
        """Whether this step may draft: not while closed, nor when drafted steps wait for a plain one
        to be compared with."""
        r = self.rates.setdefault(num_decodes, _Rates())
        if r.closed_for > 0:
            r.closed_for -= 1
            return False
        if r.since_plain >= GATE_FRESH:
            return False
        return bool(r.plain) or r.drafted_steps < GATE_MIN_STEPS

    def record(self, num_decodes: int, emitted: int, seconds: float, drafted: bool) -> None:
        """A decode step's whole time (drafting included) and the tokens it emitted."""
        r = self.rates.setdefault(num_decodes, _Rates())
        per = seconds / max(emitted, 1)
        if not drafted:
            r.plain = per if not r.plain else (1 - GATE_EMA) * r.plain + GATE_EMA * per
            r.since_plain = 0
            return
        r.drafted = per if not r.drafted_steps else (1 - GATE_EMA) * r.drafted + GATE_EMA * per
        r.drafted_steps += 1
        r.since_plain += 1
        if not r.plain or r.drafted_steps < GATE_MIN_STEPS:
            return
        if r.drafted > (1 - MIN_GAIN) * r.plain:  # drafting doesn't clearly win: stop, look again later
            r.closed_for, r.backoff = r.backoff, min(2 * r.backoff, GATE_BACKOFF_MAX)
            r.drafted_steps = 0
        else:
            r.backoff = GATE_BACKOFF_FIRST


class SpecPolicy:
    def __init__(self, k_max: int, cheap_probes: bool = True):
        """cheap_probes: whether an off sequence may probe with one draft now and then (prompt lookup:
        yes; a draft model: no, see the module's docstring)."""
        self.k_max = k_max
        self.cheap_probes = cheap_probes
        self.costs = StepCosts()
        self.gate = SpeedGate()
        self.states: dict[str, SeqSpecState] = {}
        self.seen = SeqSpecState()  # acceptance over all sequences: a new one's prior
        self.steps = 0
        self.cost = DEFAULT_SLOPE  # the last step's cost of a draft, in plain tokens
        self._new_off = 0

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
        states = [self.state(r) for r in request_ids]
        if self.steps % EXPLORE_EVERY == 0 or not self.gate.is_open(len(request_ids)):
            return [0] * len(request_ids)
        self.cost = self.token_cost(num_tokens, len(request_ids))
        return [self._length(state) for state in states]

    def state(self, request_id: str) -> SeqSpecState:
        """request_id's state; a new sequence's prior is what the sequences before it saw."""
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = SeqSpecState(accepted=PRIOR_WEIGHT * self.seen.alpha)
            if not best_length(state.alpha, self.cost, self.k_max):
                self._new_off += 1
                if self._new_off % NEW_SEQ_PROBE == 0:  # now and then, one starts hopeful
                    state.accepted = PRIOR_WEIGHT * max(PRIOR_ALPHA, self.seen.alpha)
        return state

    def drafts(self, request_id: str) -> bool:
        """Whether request_id would draft now (a draft model skips the prefill of one that won't)."""
        return best_length(self.state(request_id).alpha, self.cost, self.k_max) > 0

    def _length(self, state: SeqSpecState) -> int:
        k = best_length(state.alpha, self.cost, self.k_max)
        if k or not self.cheap_probes:
            state.idle, state.probe_every = 0, PROBE_FIRST
            return k
        state.idle += 1
        if state.idle < state.probe_every:
            return 0
        state.idle, state.probe_every = 0, min(2 * state.probe_every, PROBE_MAX)
        return 1

    def record_verify(self, request_id: str, drafted: int, accepted: int) -> None:
        self.state(request_id).record(drafted, accepted)
        self.seen.record(drafted, accepted, SEEN_DECAY)

    def record_step(
        self, num_decodes: int, num_tokens: int, emitted: int, seconds: float, draft_seconds: float
    ) -> None:
        """A decode step of num_decodes sequences and num_tokens query tokens (drafts included) emitted
        `emitted` tokens in `seconds`, draft_seconds of which went to drafting."""
        drafted = num_tokens - num_decodes
        self.costs.record(num_tokens, seconds - draft_seconds, draft_seconds / drafted if drafted else None)
        self.gate.record(num_decodes, emitted, seconds, drafted > 0)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
