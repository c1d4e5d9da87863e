"""How many tokens each sequence drafts: its recent acceptance rate against the measured cost of drafting,
and a gate on the measured speed of the steps themselves, so that speculation is never a net slowdown.

A verify step of k drafts kept each with probability alpha emits E(k) = (1 - alpha^(k+1)) / (1 - alpha)
tokens instead of one. It costs k more query rows (this machine's own measured step times, by query
tokens: a few rows ride along with the weight reads nearly free, more become compute) plus the drafting
itself (its measured time per drafted token, a draft model's usual catch-up of one or two tokens
included; a one-off catch-up on a long stretch is not a per-token cost and is left out). In units of the
sequence's share of a plain step, that is 1 + cost(k); a sequence drafts the k that maximises
E(k) / (1 + cost(k)), and none unless that ratio clears MIN_GAIN (speculation off). Steps that ran a
thread-count probe are not costs and are not recorded (engine/spec_decode.py).

Prompt lookup probes an off sequence with one draft now and then (exponentially rarer while it keeps
failing); a draft model does not (its K/V would first have to catch up on every token since it last
drafted, which costs about a tenth of a target step per token). A new sequence starts from the acceptance
rate of the sequences before it, and every NEW_SEQ_PROBE-th one that would start off starts hopeful
instead, so a workload that begins to pay is noticed.

The gate checks the model against what it buys: per number of decoding sequences, the seconds per emitted
token (decayed sums of seconds over sums of tokens) of steps with drafts against plain steps (every
EXPLORE_EVERY-th step is plain, to keep that measured, and the step after GATE_FRESH drafted ones too, so
the two are compared under the same load). When the drafted steps are not MIN_GAIN faster, drafting stops
for that batch width for a while (doubling while it keeps losing). At a wide batch each verify row costs
nearly a whole decode row, and there the gate is what turns speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.recent_median import push_lower_median

PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 2.0  # a first sequence's acceptance rate, as if from 2 drafted tokens
DECAY = 0.7  # weight of the past in a sequence's acceptance counts, per verify step
SEEN_DECAY = 0.95  # the same across all sequences, per verify step: a new sequence's prior
NEW_SEQ_PROBE = 8  # every 8th new sequence that would start off starts from PRIOR_ALPHA instead
MIN_GAIN = 0.05  # a predicted speed-up below 5% is within measurement noise: not worth a draft
PROBE_FIRST, PROBE_MAX = 8, 64  # steps an off sequence waits before one probe draft (prompt lookup)
EXPLORE_EVERY = 32  # decode steps between plain steps that re-measure the step time without drafts
EMA = 0.2  # weight of a new measurement in the drafting time per token
RECENT = 5  # steps of one size whose lower median is its step time
DEFAULT_SLOPE = 0.05  # step time per extra token, as a fraction of a step, before any is measured
GATE_EMA = 0.1  # decay per step of the gate's sums of seconds and tokens
GATE_MIN_STEPS = 8  # drafted steps between the gate's judgements (fewer: the luck of acceptance decides)
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


def linear_costs(cost: float, k_max: int) -> list[float]:
    """Draft costs where each draft costs `cost` plain tokens (see best_length)."""
    return [k * cost for k in range(1, k_max + 1)]


def best_length(alpha: float, costs: list[float]) -> int:
    """The draft length with the best speed-up E(k) / (1 + costs[k - 1]), k drafts costing costs[k - 1]
    plain tokens; 0 when none beats plain decoding by MIN_GAIN."""
    best, ratio = 0, 1.0 + MIN_GAIN
    for k, cost in enumerate(costs, start=1):
        r = expected_tokens(k, alpha) / (1.0 + max(cost, 0.0))
        if r > ratio:
            best, ratio = k, r
    return best


class StepCosts:
    """Step seconds by query tokens in the step (decode and verify steps only: prefill chunks would
    swamp them), the lower median of each size's last RECENT steps (a size is measured only while drafts
    make it, so one slow step must not price it out for good), and drafting seconds per drafted token
    (an exponential moving average: every drafting step samples it)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.draft_per_token = 0.0
        self._seen: set[int] = set()
        self._recent: dict[int, list[float]] = {}
        self._draft_seen = False

    def record(self, num_tokens: int, seconds: float, draft_per_token: float | None = None) -> None:
        """A step of num_tokens query tokens took `seconds` in the target; drafting, where there was
        a steady-state sample of it, cost draft_per_token seconds per drafted token."""
        if draft_per_token is not None:
            if self._draft_seen:  # the first drafting step may load or compile the draft's kernels
                old_per = self.draft_per_token
                self.draft_per_token = (
                    draft_per_token if not old_per else (1 - EMA) * old_per + EMA * draft_per_token
                )
            self._draft_seen = True
        if num_tokens not in self._seen:  # a size's first step may load or compile kernels: not a cost
            self._seen.add(num_tokens)
            return
        self.times[num_tokens] = push_lower_median(self._recent.setdefault(num_tokens, []), seconds, RECENT)

    def step_time(self, num_tokens: int) -> float | None:
        """The measured time of a step of num_tokens: linear between the measured sizes around it,
        extended past the last ones by their slope (DEFAULT_SLOPE of a step per token when only one size
        is measured). Per-token costs are not constant: a few extra rows ride along with the weight
        reads nearly free, more become compute (a 1.5B's 3-row step costs ~1.1 plain ones, 5 rows ~1.6)."""
        if num_tokens in self.times:
            return self.times[num_tokens]
        sizes = sorted(self.times)
        if not sizes:
            return None
        if len(sizes) == 1:
            t = self.times[sizes[0]]
            return max(t * (1.0 + DEFAULT_SLOPE * (num_tokens - sizes[0])), 1e-6)
        below = [n for n in sizes if n < num_tokens][-1:]
        above = [n for n in sizes if n > num_tokens][:1]
        a, b = (below + above) if below and above else (sizes[:2] if not below else sizes[-2:])
        slope = (self.times[b] - self.times[a]) / (b - a)
        return max(self.times[a] + slope * (num_tokens - a), 1e-6)


@dataclass(slots=True)
class _Rates:
    # decayed sums of seconds and emitted tokens: seconds per token is their ratio, not an average of
    # per-step ratios (a verify step emits 1 to k+1 tokens; at k = 2 and 80% kept, the mean of seconds /
    # emitted over such steps overstates their cost by 1.2x, which closed the gate on a 1.2x win)
    plain_seconds: float = 0.0
    plain_tokens: float = 0.0
    drafted_seconds: float = 0.0
    drafted_tokens: float = 0.0
    drafted_steps: int = 0  # drafted steps measured since the gate last judged
    since_plain: int = 0  # drafted steps since the last plain one
    closed_for: int = 0  # steps left with drafting off
    backoff: int = GATE_BACKOFF_FIRST

    @property
    def plain(self) -> float:
        """Seconds per token of plain steps (0: none measured yet)."""
        return self.plain_seconds / self.plain_tokens if self.plain_tokens else 0.0

    @property
    def drafted(self) -> float:
        return self.drafted_seconds / self.drafted_tokens if self.drafted_tokens else 0.0


class SpeedGate:
    """Per number of decoding sequences: are steps with drafts faster per emitted token than plain ones?
    Judged every GATE_MIN_STEPS drafted steps."""

    def __init__(self) -> None:
        self.rates: dict[int, _Rates] = {}

    def is_closed(self, num_decodes: int) -> bool:
        """Whether drafting is stopped at this batch width now (without counting a step)."""
        r = self.rates.get(num_decodes)
        return r is not None and r.closed_for > 0

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
        keep = 1.0 - GATE_EMA
        if not drafted:
            r.plain_seconds = keep * r.plain_seconds + seconds
            r.plain_tokens = keep * r.plain_tokens + max(emitted, 1)
            r.since_plain = 0
            return
        r.drafted_seconds = keep * r.drafted_seconds + seconds
        r.drafted_tokens = keep * r.drafted_tokens + max(emitted, 1)
        r.drafted_steps += 1
        r.since_plain += 1
        if not r.plain or r.drafted_steps < GATE_MIN_STEPS:
            return
        r.drafted_steps = 0
        if r.drafted > (1 - MIN_GAIN) * r.plain:  # drafting doesn't clearly win: stop, look again later
            r.closed_for, r.backoff = r.backoff, min(2 * r.backoff, GATE_BACKOFF_MAX)
            r.drafted_seconds = r.drafted_tokens = 0.0  # the next opening measures afresh
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
        self.cost = linear_costs(DEFAULT_SLOPE, k_max)  # the last step's costs of 1..k_max drafts
        self._new_off = 0

    def draft_costs(self, num_tokens: int, num_decodes: int) -> list[float]:
        """What k = 1..k_max drafts of one sequence cost, in tokens the step's decodes would yield
        meanwhile: the measured step time with k more query tokens, plus k drafted tokens' drafting."""
        base = self.costs.step_time(num_tokens)
        if base is None:
            return linear_costs(DEFAULT_SLOPE * num_decodes, self.k_max)
        per = self.costs.draft_per_token
        return [
            (self.costs.step_time(num_tokens + k) - base + k * per) * num_decodes / base  # type: ignore[operator]
            for k in range(1, self.k_max + 1)
        ]

    def lengths(self, request_ids: list[str], num_tokens: int) -> list[int]:
        """The draft length of each decoding sequence this step (num_tokens: the step's plain tokens)."""
        self.steps += 1
        states = [self.state(r) for r in request_ids]
        if self.steps % EXPLORE_EVERY == 0 or not self.gate.is_open(len(request_ids)):
            return [0] * len(request_ids)
        self.cost = self.draft_costs(num_tokens, len(request_ids))
        return [self._length(state) for state in states]

    def state(self, request_id: str) -> SeqSpecState:
        """request_id's state; a new sequence's prior is what the sequences before it saw."""
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = SeqSpecState(accepted=PRIOR_WEIGHT * self.seen.alpha)
            if not best_length(state.alpha, self.cost):
                self._new_off += 1
                if self._new_off % NEW_SEQ_PROBE == 0:  # now and then, one starts hopeful
                    state.accepted = PRIOR_WEIGHT * max(PRIOR_ALPHA, self.seen.alpha)
        return state

    def drafts(self, request_id: str, num_decodes: int) -> bool:
        """Whether request_id would draft now, among num_decodes decoding sequences (a draft model skips
        the prefill of one that won't: where the gate has closed drafting at this batch width, a draft
        prefill would be wasted; should it open later, the sequence's first draft catches up)."""
        if self.gate.is_closed(num_decodes):
            return False
        return best_length(self.state(request_id).alpha, self.cost) > 0

    def _length(self, state: SeqSpecState) -> int:
        k = best_length(state.alpha, self.cost)
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
        self, num_decodes: int, num_tokens: int, emitted: int, seconds: float, draft_seconds: float,
        steady: bool = True,
    ) -> None:  # fmt: skip
        """A decode step of num_decodes sequences and num_tokens query tokens (drafts included) emitted
        `emitted` tokens in `seconds`, draft_seconds of which went to drafting. steady: the drafting was
        the usual kind (a draft model that first caught up on a long stretch was not: a sequence turning
        hopeful pays that once, and as a per-token cost, or in the gate's rates, it would turn
        speculation off for everyone)."""
        drafted = num_tokens - num_decodes
        per = draft_seconds / drafted if drafted and steady else None
        self.costs.record(num_tokens, seconds - draft_seconds, per)
        if steady:  # the gate's per-token rates would carry a one-off catch-up for several steps
            self.gate.record(num_decodes, emitted, seconds, drafted > 0)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
