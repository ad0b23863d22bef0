"""Per-request draft depth, chosen each step to maximize tokens per second — and never to lose.

Each request keeps an estimate of its own acceptance: ``alpha[j]``, the probability that draft
position ``j`` is accepted given the positions before it were (an exponential moving average,
starting from what requests like it have been accepting). Drafting ``k`` positions then yields, in
expectation, ``1 + sum_{i<=k} prod_{j<=i} alpha[j]`` tokens from one verify step.

The cost side is a :class:`CostModel` of measured forward times, keyed by the shape the step runs
(sequences × tokens), profiled at start-up over those shapes and refreshed online; each cell keeps
its last observations and answers with their *median*, so one noisy timing moves nothing. The
proposer declares its cost shape (:class:`~engine.speculative.proposer.CostShape`): a draft model's
catch-up and per-level forwards, or nothing at all for a lookup.

Planning: for each candidate maximum depth ``D``, every request keeps the positions whose expected
gain beats the marginal price of the target time they take (the current rate times that time);
the ``D`` with the best predicted rate wins — but the current ``D`` is only left when another beats
it by a margin or for several steps in a row (hysteresis). Finally a measured :class:`Guard`
compares the tokens/s that speculating and plain steps really achieved at the same batch size, and
turns speculation off where it loses (probing with bursts of real drafting now and then, so that it
notices when it wins again). Exploration — a new request's first drafts, an idle request's probes,
both at full depth — happens only where it could pay, and the guard does not judge it.

Exploring and probing cost real time wherever speculation loses, and traffic of many short requests
would explore all the time (each new request trials, each new batch earns a burst, and a burst
that kept up by luck turns speculation back on): an :class:`ExplorationBudget` keeps what they lose
against plain decoding to a small share of the time, so a server where drafting never pays runs
within that share of plain decoding.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request.sequence import Sequence
from engine.request.state import AcceptanceEstimate
from engine.runner.model_runner import ForwardChunk

if TYPE_CHECKING:
    from engine.speculative.proposer import CostShape


class CostModel:
    """Seconds per forward of a ``kind`` ("target", a proposer's kind) by batch shape.

    Cells are keyed by the power-of-two buckets of the sequence count and the token count; each keeps
    its last ``window`` observations and answers with their medians. Predictions interpolate
    linearly in tokens within the nearest measured sequence bucket, never decreasing with tokens.
    """

    def __init__(self, window: int = 9) -> None:
        self.window = window
        self.cells: dict[tuple[str, int, int], deque[tuple[int, float]]] = {}
        # Host-side work outside the forwards: seconds per sequence in a plain step, and extra seconds
        # per drafting sequence (bookkeeping of drafts and verification).
        self.host_per_seq: deque[float] = deque(maxlen=window)
        self.host_per_draft: deque[float] = deque(maxlen=window)
        # Planning asks for many predictions per step: each (kind, sequence bucket)'s curve of
        # (median tokens, median seconds) points is built once and kept until a new observation.
        self._curves: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self._rows: dict[str, list[int]] = {}
        self._host: tuple[float, float] | None = None  # medians of host_per_seq and host_per_draft
        # Realised over predicted extra seconds of whole speculating steps (see spec_scale).
        self.spec_ratio: deque[float] = deque(maxlen=window)
        self._scale: float | None = None
        self._step_tokens: dict[str, int] = {}  # tokens each kind's forwards ran since the last step ended
        self._ready_kinds: tuple[str, ...] | None = None  # the kinds ready() last found timed

    def observe(self, kind: str, num_seqs: int, tokens: int, seconds: float) -> None:
        if tokens <= 0 or num_seqs <= 0:
            return
        self._step_tokens[kind] = self._step_tokens.get(kind, 0) + tokens
        key = (kind, num_seqs.bit_length(), tokens.bit_length())
        self.cells.setdefault(key, deque(maxlen=self.window)).append((tokens, seconds))
        self._curves.pop((kind, key[1]), None)
        self._rows.pop(kind, None)

    def observe_host(self, host_seconds: float, num_seqs: int, num_drafting: int) -> None:
        if num_seqs <= 0:
            return
        if num_drafting == 0:
            self.host_per_seq.append(host_seconds / num_seqs)
        elif self.host_per_seq:
            base = statistics.median(self.host_per_seq) * num_seqs
            self.host_per_draft.append(max(host_seconds - base, 0.0) / num_drafting)
        self._host = None

    def take_step_tokens(self, kinds: tuple[str, ...]) -> int:
        """Tokens the forwards of ``kinds`` ran in the step just ended (and start counting the next)."""
        tokens, self._step_tokens = sum(self._step_tokens.get(kind, 0) for kind in kinds), {}
        return tokens

    def observe_spec_scale(self, ratio: float) -> None:
        self.spec_ratio.append(min(max(ratio, 0.2), 5.0))
        self._scale = None

    def spec_scale(self) -> float:
        """How the seconds drafting really added to whole steps compare with the sum of the parts
        predicted for them (median; 1 before any): the catch-up's real size, the draft's weights
        falling out of the caches between steps, bookkeeping no part times."""
        if self._scale is None:
            self._scale = statistics.median(self.spec_ratio) if self.spec_ratio else 1.0
        return self._scale

    def host_seconds(self, num_seqs: int, num_drafting: int) -> float:
        """Predicted host time of a step of ``num_seqs`` sequences, ``num_drafting`` of them drafting."""
        if self._host is None:
            self._host = tuple(statistics.median(d) if d else 0.0 for d in (self.host_per_seq, self.host_per_draft))
        return self._host[0] * num_seqs + self._host[1] * num_drafting

    def predict(self, kind: str, num_seqs: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        rows = self._rows.get(kind)
        if rows is None:
            rows = self._rows[kind] = sorted({sb for (k, sb, _) in self.cells if k == kind})
        if not rows:
            return 0.0
        want = max(num_seqs, 1).bit_length()
        mono = self._curve(kind, min(rows, key=lambda r: (abs(r - want), -r)))
        if tokens <= mono[0][0]:
            return mono[0][1]
        for (t0, s0), (t1, s1) in zip(mono, mono[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1e-9)
        t1, s1 = mono[-1]
        if len(mono) == 1:
            return s1 * tokens / t1
        t0, s0 = mono[-2]
        return s1 + max((s1 - s0) / max(t1 - t0, 1e-9), 0.0) * (tokens - t1)

    def _curve(self, kind: str, sb: int) -> list[tuple[float, float]]:
        curve = self._curves.get((kind, sb))
        if curve is None:
            pts = sorted(
                (statistics.median(t for t, _ in obs), statistics.median(x for _, x in obs))
                for (k, s, _), obs in self.cells.items()
                if k == kind and s == sb
            )
            curve = []
            for t, sec in pts:  # a forward never gets cheaper with more tokens
                curve.append((t, max(sec, curve[-1][1]) if curve else sec))
            self._curves[(kind, sb)] = curve
        return curve

    def ready(self, kinds: tuple[str, ...]) -> bool:
        """Whether every kind has a timing (asked every plan: a cell is never removed, so once true, true)."""
        if self._ready_kinds != kinds:
            if not all(any(k == kind for k, _, _ in self.cells) for kind in kinds):
                return False
            self._ready_kinds = kinds
        return True


class _Bucket:
    """One guard bucket: its latest realised steps of each kind (``(tokens, seconds)``) and its state."""

    def __init__(self, window: int, probe_every: int) -> None:
        self.plain: deque[tuple[int, float]] = deque(maxlen=window)
        self.spec: deque[tuple[int, float]] = deque(maxlen=window)
        self.on = True  # the controller's depths stand; off: plain steps only
        self.plans = 0
        self.interval = self.wait = probe_every  # while off: plans between probe bursts, and until the next
        self.burst_left = 0  # while off: probe-burst steps still to run
        self.probing = False  # a burst ran: judge it at the next plan, when all its steps are observed
        self.skip_next = False  # a burst's first step pays the proposer's catch-up: not judged
        self.judged: frozenset = frozenset()  # while off: the requests the last verdict was about
        self.probation = 0  # after a burst turned it on: speculating steps still on trial (see Guard)


class ExplorationBudget:
    """What exploration (trials, idle probes, the guard's bursts) has lost against plain decoding, kept
    within ``fraction`` of the time: a step that explores is charged its seconds beyond what plain
    decoding takes for the tokens it made (negative where it won), every decode-only step adds its
    seconds to the time, and both sums decay by ``decay`` a step, so the share is of recent time.
    Exploration waits while the charges, with what the next exploring step is likely to lose (the
    recent steps' charges, averaged), would exceed the share: a step is not let in on a budget it
    would overdraw by its own cost (a request's first draft feeds the draft its whole prompt: several
    plain steps' time). Exploration that wins pays for more."""

    def __init__(self, fraction: float = 0.01, decay: float = 0.998) -> None:
        self.fraction, self.decay = fraction, decay
        self.spent = 0.0  # decayed seconds lost by exploring steps
        self.elapsed = 0.0  # decayed seconds of every decode-only step
        self.charge: float | None = None  # moving average of the exploring steps' charges

    def allows(self) -> bool:
        return self.spent + max(self.charge or 0.0, 0.0) <= self.fraction * self.elapsed

    def observe(self, seconds: float, excess: float | None = None) -> None:
        """A decode-only step of ``seconds``; ``excess``: an exploring step's seconds beyond plain decoding's."""
        self.spent = self.spent * self.decay + (excess or 0.0)
        self.elapsed = self.elapsed * self.decay + seconds
        if excess is not None:
            self.charge = excess if self.charge is None else 0.5 * (self.charge + excess)


def _rate(steps: deque[tuple[int, float]]) -> float:
    seconds = sum(s for _, s in steps)
    return sum(t for t, _ in steps) / seconds if seconds > 0 else 0.0


class Guard:
    """Measured tokens/s of speculating vs plain decode-only steps, per bucket: the batch size's power
    of two, and whether the batch is all greedy (sampled text is accepted far less often, so a server
    whose sampled traffic makes speculation lose must not stop speculating for its greedy traffic).

    A rate is a ratio of sums over a kind's last ``window`` steps: a step's tokens vary with what was
    accepted, a sum over many steps does not flip on one. A bucket is *on* (the controller's depths
    stand, whatever they are) or *off* (plain steps: no draft forward at all). It turns off as soon as
    speculation's rate falls below ``margin`` times plain decoding's. While off it runs a *burst* of
    ``burst`` speculating steps every ``interval`` plans with every request at full depth (not one
    token at a time: with a fixed cost per drafting step, shallow drafts lose where deep ones win; a
    positive limit while a bucket is off is a burst step), and judges the burst alone. A burst that keeps up with plain
    decoding turns the bucket back on; otherwise the interval doubles (up to ``max_interval``), so a
    bucket where speculation keeps losing spends ever less on probing, and a burst whose first steps
    run below ``abort`` times plain decoding stops early, as does one the exploration budget no
    longer allows. A verdict is about the requests it saw: once
    none of them is left in the batch (a new conversation at one request a time, a turned-over batch),
    the next burst is at most ``probe_every`` plans away. Plain rates are learnt early (every 4th step
    of a bucket is plain until it has ``min_samples`` of them) and kept current (one plain step every
    ``probe_every`` plans while on).

    A burst that turns a bucket back on may have kept up by luck (a few steps against a window of
    plain ones, on a host whose speed drifts). Its next ``window`` speculating steps are a
    *probation*: still exploration, so the controller charges them to the exploration budget, and a
    probation the budget can no longer pay for, or one the guard judges losing, turns the bucket off
    with the interval doubled, as a lost burst would (a burst that kept up while the budget is spent
    waits for it). Without it a bucket where speculation loses flaps (burst, on, off, burst 64 plans
    later), and the on-phases' losses escape the budget; with it they are charged, which is what bounds
    them where verdicts keep expiring (one request at a time).
    """

    def __init__(
        self,
        max_depth: int,
        margin: float = 0.97,
        window: int = 32,
        min_samples: int = 8,
        probe_every: int = 64,
        burst: int = 10,
        max_interval: int = 1024,
        abort: float = 0.8,
    ) -> None:
        self.max_depth, self.margin, self.window, self.min_samples = max_depth, margin, window, min_samples
        self.probe_every, self.burst, self.max_interval, self.abort = probe_every, burst, max_interval, abort
        self.buckets: dict[tuple[int, bool], _Bucket] = {}

    def bucket(self, num_seqs: int, greedy: bool = True) -> _Bucket:
        key = (num_seqs.bit_length(), greedy)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(self.window, self.probe_every)
        return self.buckets[key]

    def observe(
        self,
        num_seqs: int,
        tokens: int,
        seconds: float,
        speculated: bool,
        greedy: bool = True,
        members: frozenset = frozenset(),
    ) -> None:
        if seconds <= 0 or num_seqs <= 0:
            return
        b = self.bucket(num_seqs, greedy)
        if not speculated:
            b.plain.append((tokens, seconds))
        elif b.skip_next:
            b.skip_next = False
        else:
            b.spec.append((tokens, seconds))
            if b.on and min(len(b.spec), len(b.plain)) >= self.min_samples and not self._keeps_up(b):
                self._turn_off(b, members)
            elif b.on and b.probation:
                b.probation -= 1
            elif b.burst_left and len(b.spec) >= 3 and _rate(b.spec) < self.abort * _rate(b.plain):
                b.burst_left = 0  # a burst that is clearly losing stops early

    def _turn_off(self, b: _Bucket, members: frozenset) -> None:
        """Speculation lost: plain steps, and the next burst ``probe_every`` plans away, or (a probation
        that failed: the burst's verdict was wrong) twice the last interval."""
        b.interval = min(2 * b.interval, self.max_interval) if b.probation else self.probe_every
        b.on, b.wait, b.probation = False, b.interval, 0
        b.spec.clear()  # the next burst is judged on its own steps
        b.judged = members

    def holds_plain(self, b: _Bucket, may_probe: Callable[[], bool]) -> bool:
        """A plan of ``b``'s batch, the same requests as at its last plan: where the guard's answer is
        plain for certain (``b`` off between bursts, plain decoding's rate learned, and the next burst
        not due or the exploration budget not allowing it: ``may_probe``, asked only then), counts it
        down to the next burst as :meth:`limit` would and returns True; else False, changing nothing.
        (The same requests: a verdict on them cannot have expired since their last plan.)"""
        if b.on or b.burst_left or b.probing or len(b.plain) < self.min_samples:
            return False
        if b.wait <= 1 and may_probe():
            return False  # a burst is due: limit starts it
        b.plans += 1
        b.wait = max(b.wait - 1, 1)
        return True

    def _keeps_up(self, b: _Bucket) -> bool:
        return _rate(b.spec) >= self.margin * _rate(b.plain)

    def limit(
        self, num_seqs: int, greedy: bool = True, members: frozenset = frozenset(), may_probe: bool = True
    ) -> int:
        """The most draft depth allowed this step (0: a plain step) for a batch of ``num_seqs``, all
        greedy or not; ``members`` names the batch's requests. A burst due while ``may_probe`` is
        false (the exploration budget is spent) waits for it."""
        b = self.bucket(num_seqs, greedy)
        b.plans += 1
        if not b.on and members and b.judged and not members & b.judged:
            b.judged, b.wait = frozenset(), min(b.wait, self.probe_every)  # a verdict on requests now gone
        if len(b.plain) < self.min_samples and b.plans % 4 == 0:
            return 0  # learn plain decoding's rate at this batch size early
        if b.on:
            if b.probation and not may_probe:  # a probation the exploration budget can no longer pay for
                self._turn_off(b, members)
                return 0
            return 0 if b.plans % self.probe_every == 0 else self.max_depth
        if b.burst_left:
            if may_probe:
                b.burst_left -= 1
                return self.max_depth
            b.burst_left = 0  # a burst the budget can no longer pay for ends here, judged on what it ran
        if b.probing:  # every step of the burst has been observed by now
            if len(b.spec) >= self.min_samples // 2 and self._keeps_up(b):
                if not may_probe:
                    return 0  # a burst that kept up: its probation starts when the budget can pay for it
                b.probing, b.on, b.probation = False, True, self.window
                return self.max_depth
            b.probing = False
            b.interval = min(2 * b.interval, self.max_interval)
            b.wait = b.interval
            b.spec.clear()
            b.judged = members
        b.wait -= 1
        if b.wait > 0 or not may_probe:
            b.wait = max(b.wait, 1)
            return 0
        b.probing, b.burst_left, b.skip_next = True, self.burst - 1, True
        b.spec.clear()
        return self.max_depth


@dataclass
class _IdleRun:
    """A plan that drafted nothing, answered again for the same batch without a search (see
    :meth:`SpecController.plan`): ``left`` more times; ``skipped`` so far, each a step whose routes aged,
    counted on the requests by :meth:`catch_up`. The requests' idle steps are counted as the plans
    go, and their trials and idle probes served (:meth:`SpecController._idle_plan`)."""

    key: tuple  # (the requests' ids, other tokens, room, the guard's cap, the cost model, the evidence count)
    seqs: list  # the batch's requests
    left: int
    free: list[int]  # the requests whose depth the controller chooses (their indices)
    trial: list[bool]  # (of each free one) whether its trials are still to come
    skipped: int = 0

    def catch_up(self) -> None:
        for s in self.seqs:
            s.spec_route_age -= self.skipped


@dataclass
class _PlainRun:
    """A batch the guard held plain at its last plan (see :meth:`SpecController._held_plain`)."""

    ids: list[int]  # its requests, in plan order
    guard: Guard  # (the controller's guard then: a new one starts afresh)
    bucket: _Bucket


@dataclass
class SpecController:
    max_depth: int
    proposer: object  # engine.speculative.proposer.Proposer: its slots_needed and cost shape
    cost: CostModel = field(default_factory=CostModel)
    budget: ExplorationBudget = field(default_factory=ExplorationBudget)
    prior: float = 0.6
    min_gain: float = 0.02  # never draft a position expected to add less than this
    switch_margin: float = 0.03  # leave the current depth only for a predicted gain above this ...
    patience: int = 3  # ... or when another depth was best this many plans in a row
    reuse_plans: int = 7  # an unchanged batch (requests, estimates, room) reuses its plan this many times
    # ... and a plan that drafts nothing this many: no request's estimate moves while nothing drafts
    # (a trial or probe that drafts changes the key), so only the timings could change its answer.
    reuse_idle_plans: int = 31
    trial_steps: int = 3  # a request's first verified drafts are at full depth: its own estimate, soon
    idle_probe: int = 32  # a request kept at zero drafts at full depth again after this many steps
    optimism: float = 0.9  # per-position acceptance of the most predictable text (exploration's bound)
    route_every: int = 8  # plans between choices of an undrafted request's route (see _choose_routes)
    low_acceptance: float = 0.25  # a request kept at zero below this first-position estimate: "acceptance"

    def __post_init__(self) -> None:
        # Population estimates (greedy / sampled requests accept very differently): a new request
        # starts from what requests like it have been accepting, not from a fixed guess.
        # Kept per route too: what requests accept by each proposer.
        self.population: dict[tuple[str, bool, str | None], AcceptanceEstimate] = {}
        self.routes = self.proposer.routes()  # the proposers a request may pin
        self.choices = self.proposer.choices()  # those the controller chooses among
        self.guard = Guard(self.max_depth)
        # The current maximum depth (hysteresis state), for all-greedy batches and for the others.
        self.depth = {True: self.max_depth, False: self.max_depth}
        self._challenger, self._streak = {True: None, False: None}, {True: 0, False: 0}
        self._memo: dict[tuple, float] = {}
        self._last_key, self._last_plan, self._reused = None, (), 0
        self._idle: _IdleRun | None = None  # the plan that drafted nothing, answered again without a search
        self._plain: _PlainRun | None = None  # plans the guard holds plain, answered without a plan
        self._evidence = 0  # acceptance observations so far (update, asked): an idle plan stands while none come
        self._cap = self.max_depth  # the guard's limit for this step's plan
        self._route_slots: dict[tuple[str, bool], list[int]] = {}  # slots_for at each depth, per route
        self.exploring = False  # this step's plan holds a trial or an idle probe (see observe_step)
        self.bursting = False  # this step's plan is a guard's probe burst
        self.on_probation = False  # this step's bucket is on probation (see Guard): its drafting is charged

    def forwards_changed(self) -> None:
        """The engine swapped its forwards (the compiled ones in for the eager ones, between two steps):
        every timing learned so far is another forward's, and those of the minutes before were taken
        while a compiler shared the cores. The cost model, the guard's verdicts and the exploration
        budget start afresh (the cost model relearns from the steps that follow: until it has timings,
        requests draft at full depth, as at start-up before the profile); what requests accept stays,
        being their texts'. Without it a verdict of those minutes (drafting turned off, an overdrawn
        budget, verify rows priced at eager, contended costs) outlives them for hundreds of steps."""
        self.cost = CostModel(self.cost.window)
        self.guard = Guard(self.max_depth)
        self.budget = ExplorationBudget(self.budget.fraction, self.budget.decay)
        self.depth = {True: self.max_depth, False: self.max_depth}
        self._challenger, self._streak = {True: None, False: None}, {True: 0, False: 0}
        self._memo, self._last_key, self._last_plan, self._reused = {}, None, (), 0
        self._plain = None
        if self._idle is not None:
            self._idle.catch_up()
            self._idle = None

    def _population(self, route: str, seq: Sequence) -> AcceptanceEstimate:
        """What requests like ``seq`` accept by ``route``: greedy or sampled, under its LoRA adapter (an
        adapter far from the base model accepts a base-model draft less: its requests start from its
        own evidence, not the base model's)."""
        key = (route, seq.params.greedy, seq.params.lora)
        if key not in self.population:
            self.population[key] = AcceptanceEstimate([self.prior] * self.max_depth, ema=0.05)
        return self.population[key]

    def forget_adapter(self, name: str) -> None:
        """Drop the acceptance learned from LoRA adapter ``name``'s requests: it was unloaded, or a new
        adapter is loading under its name (which starts from the prior, not the old one's evidence)."""
        for key in [k for k in self.population if k[2] == name]:
            del self.population[key]

    def estimate(self, seq: Sequence, route: str | None = None) -> AcceptanceEstimate:
        """The request's acceptance estimate by ``route`` (None: the route it drafts by now)."""
        route = route or seq.spec_route or self.routes[0]
        est = seq.spec_estimates.get(route)
        if est is None:  # what requests like it have been accepting, and how often the route had a draft
            pop = self._population(route, seq)
            est = seq.spec_estimates[route] = AcceptanceEstimate(list(pop.alpha), found=pop.found)
        return est

    def plan(self, seqs: list[Sequence], other_tokens: int, room: list[int] | None = None) -> list[int]:
        """Draft depth per decode sequence (0 = none); ``room[i]`` caps sequence i's depth and
        ``other_tokens`` counts the step's non-speculative target tokens (prefill chunks). Each
        sequence's route (the proposer that drafts it) is chosen first (``Sequence.spec_route``), and a
        sequence left at zero gets the reason in a word (``Sequence.spec_reason``):

        - ``disabled``: the request asked for no speculation;
        - ``load``: the guard measured drafting losing at this batch size (``cost`` for a batch of one);
        - ``acceptance``: its own estimate keeps fewer than ``low_acceptance`` of first draft positions;
        - ``cost``: what drafting would return does not pay for what it takes (verify rows, drafting).
        """
        room = room if room is not None else [self.max_depth] * len(seqs)
        if self._held_plain(seqs, room):
            return [0] * len(seqs)
        self._memo = {}
        greedy = all(s.params.greedy for s in seqs)
        ids = tuple(s.seq_id for s in seqs)
        cap = self._cap = self.guard.limit(len(seqs), greedy, frozenset(ids), self.budget.allows())
        idle = self._idle
        state = (ids, other_tokens, tuple(min(r, self.max_depth) for r in room), cap, id(self.cost), self._evidence)
        if idle is not None and idle.left > 0 and state == idle.key and self._idle_plan(idle, room, other_tokens, cap):
            # The batch of the last plan, which drafted nothing: the same answer, and no search. Each
            # request's route age is counted when the plans search again (``catch_up``).
            idle.left -= 1
            idle.skipped += 1
            bucket = self.guard.bucket(len(seqs), greedy)
            self.exploring = self.bursting = False
            self.on_probation = bucket.on and bucket.probation > 0
            return [0] * len(seqs)
        if idle is not None:
            self._idle = None
            idle.catch_up()
            self._reused += idle.skipped
        if cap or any(s.params.num_draft_tokens for s in seqs):  # a step with no draft needs no route
            self._choose_routes(seqs, other_tokens)
        depths = self._plan(seqs, other_tokens, room, cap, greedy)
        for seq, d, r in zip(seqs, depths, room):
            seq.spec_reason = None if d or r <= 0 else self._reason(seq, len(seqs))
        if not cap and not any(depths) and min(room, default=0) > 0:  # (every request given its reason)
            self._hold_plain(seqs, greedy)
        if cap and not any(depths) and not self.exploring and not self.bursting:
            # skip searching while nothing could change its answer: the plans an idle plan is reused
            # for anyway (``reuse_idle_plans``), up to a trial or idle probe that could pay
            left = self.reuse_idle_plans - self._reused
            if left > 0:
                free = [i for i, s in enumerate(seqs) if self._free(s)]
                trial = [self.estimate(seqs[i]).updates < self.trial_steps for i in free]
                self._idle = _IdleRun(state, list(seqs), left, free, trial)
        return depths

    def _idle_plan(self, idle: _IdleRun, room: list[int], other_tokens: int, cap: int) -> bool:
        """A plan of an idle run's batch, as :meth:`_explore` would make it after a search that drafts
        nothing: each free request's idle steps counted, and a trial or idle probe that is due (with
        room, and the exploration budget allowing) served. One that could pay ends the run (False,
        nothing counted: the plan searches, and explores it); one that could not is asked again as
        ``_explore`` asks it (an idle probe ``idle_probe`` steps later)."""
        seqs = idle.seqs
        due = []
        for i, trial in zip(idle.free, idle.trial):
            steps = seqs[i].spec_idle_steps + 1
            if steps >= self.idle_probe or (steps == 1 and trial):
                due.append(i)
        if due and self.budget.allows():
            zeros = [0] * len(seqs)
            for i in due:
                if room[i] > 0 and self._could_pay(i, min(self.max_depth, room[i], cap), zeros, seqs, other_tokens):
                    return False
        else:
            due = []  # (asked again at the next plan, as the budget allows)
        for i in idle.free:
            seqs[i].spec_idle_steps += 1
        for i in due:
            if room[i] > 0 and seqs[i].spec_idle_steps >= self.idle_probe:
                seqs[i].spec_idle_steps = 0
        return True

    def _free(self, seq: Sequence) -> bool:
        """Whether the controller chooses ``seq``'s depth (it pinned none and may speculate)."""
        p = seq.params
        return p.speculative is not False and self.max_depth != 0 and p.num_draft_tokens is None

    def _hold_plain(self, seqs: list[Sequence], greedy: bool) -> None:
        """After a plan the guard held plain: its batch's next plans may be answered alike."""
        bucket = self.guard.bucket(len(seqs), greedy)
        if not bucket.on:
            self._plain = _PlainRun([s.seq_id for s in seqs], self.guard, bucket)

    def _held_plain(self, seqs: list[Sequence], room: list[int]) -> bool:
        """Whether this plan is one the guard holds plain for certain (the batch of the last plan, which
        found the guard off: ``Guard.holds_plain``). It is then answered as that plan was, all zeros,
        each request keeping its reason, without the plan's work (a plain step of one request costs
        about a millisecond on a CPU; a plan is a few percent of it). A request at its last token (no
        room: it gets no reason) is planned the long way."""
        run = self._plain
        if run is None:
            return False
        if run.guard is self.guard and min(room, default=0) > 0 and [s.seq_id for s in seqs] == run.ids:
            if self.guard.holds_plain(run.bucket, self.budget.allows):
                self._memo = {}
                return True
        self._plain = None
        return False

    def _reason(self, seq: Sequence, num_seqs: int) -> str:
        if seq.params.speculative is False or seq.params.num_draft_tokens == 0 or self.max_depth == 0:
            return "disabled"
        if self._cap == 0:
            return "load" if num_seqs > 1 else "cost"
        return "acceptance" if self.estimate(seq).alpha[0] < self.low_acceptance else "cost"

    def _choose_routes(self, seqs: list[Sequence], other_tokens: int) -> None:
        """Each sequence's route this step: the one a request pinned (``speculative.method``), else the
        one whose draft returns the most over what it costs, by the request's own estimates per route
        (:meth:`_route_value`); before any timing exists, the first (a lookup: free to try)."""
        ready = len(self.choices) > 1 and self.cost.ready(("target", *self.proposer.cost_kinds()))
        if ready:
            n, rows = len(seqs) + (1 if other_tokens else 0), other_tokens + len(seqs)
            plain = self._predict("target", n, rows) + self.cost.host_seconds(len(seqs), 0)
            rate = rows / max(plain, 1e-9)  # tokens a second the batch makes without drafts
            row = max(self._predict("target", n, rows + 8) - self._predict("target", n, rows), 0.0) / 8
            users: dict[str | None, int] = {}
            for s in seqs:
                users[s.spec_route] = users.get(s.spec_route, 0) + 1
        for s in seqs:
            if s.params.speculative_method:
                s.spec_route = s.params.speculative_method
            elif not ready:
                s.spec_route = s.spec_route if s.spec_route in self.choices else self.choices[0]
            elif s.spec_route_age <= 0 or s.spec_route not in self.choices:
                # Chosen anew when its estimates moved (it was asked for a draft) or every
                # ``route_every`` plans (costs and the batch move): the search is a Python loop per
                # route and depth, a real share of a small model's step if run every step.
                s.spec_route = max(self.choices, key=lambda r: self._route_value(s, r, rate, row, users))
                s.spec_route_age = self.route_every
            else:
                s.spec_route_age -= 1

    def _route_value(self, seq: Sequence, route: str, rate: float, row: float, users: dict) -> float:
        """Tokens a draft by ``route`` is expected to add to the step beyond the tokens its cost would
        have made by plain decoding at ``rate``, at its best depth: the expected gain of each position
        (times the share of steps the route has a draft at all) against ``row`` seconds per verify
        row and, for a model drafter, what this request adds to its batched forwards (the route's
        requests with it against without it)."""
        est = self.estimate(seq, route)
        shape = self.proposer.cost_for(route)
        catch_up = level = 0.0
        if shape.kind:  # what adding this request to the route's batched forwards adds to them
            m = users.get(route, 0) + (seq.spec_route != route)  # its requests, this one among them
            if shape.catch_up:  # its own catch-up: all it missed if it sat some steps out
                pending = self.proposer.catch_up_tokens(seq, route)
                before = self._predict(shape.kind, m - 1, 2 * m - 2)
                catch_up = self._predict(shape.kind, m, 2 * m - 2 + pending) - before
            if shape.per_level:
                level = self._predict(shape.kind, m, m) - self._predict(shape.kind, m - 1, m - 1)
        scale = self.cost.spec_scale()
        slots = self._route_slots.get((route, seq.params.greedy))
        if slots is None:
            slots = [self.proposer.slots_for(route, k, seq.params.greedy) for k in range(1, self.max_depth + 1)]
            self._route_slots[(route, seq.params.greedy)] = slots
        best = total = 0.0
        for k, gain in enumerate(est.gains(self.max_depth), start=1):
            total += gain
            seconds = row * slots[k - 1] + max(catch_up, 0.0) + (k - 1) * max(level, 0.0)
            best = max(best, est.found * total - rate * scale * seconds)
        return best

    def asked(self, seq: Sequence, route: str | None, drafted: bool) -> None:
        """``seq`` was asked for a draft by ``route`` this step, and had one (or none: a lookup's miss)."""
        route = route or seq.spec_route or self.routes[0]
        self._evidence += 1
        seq.spec_route_age = 0  # its estimates move: its route is chosen anew next plan
        self.estimate(seq, route).asked(drafted)
        self._population(route, seq).asked(drafted)

    def _plan(self, seqs: list[Sequence], other_tokens: int, room: list[int], cap: int, kind: bool) -> list[int]:
        """Depths under the guard's ``cap`` for this step; ``kind``: whether the batch is all greedy."""
        self.exploring = self.bursting = False
        bucket = self.guard.bucket(len(seqs), kind)
        self.on_probation = bucket.on and bucket.probation > 0
        fixed: dict[int, int] = {}
        free: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if self._free(seq):
                free.append(i)
            elif p.speculative is False or self.max_depth == 0:
                fixed[i] = 0
            else:
                fixed[i] = min(p.num_draft_tokens, self.max_depth, room[i])
        depths = [fixed.get(i, 0) for i in range(len(seqs))]
        if not free or cap == 0:  # a plain step by the guard: no idle probes either
            return depths
        kinds = ("target", *self.proposer.cost_kinds())
        bursting = not bucket.on  # the guard's probe burst
        if bursting or not self.cost.ready(kinds):
            # Before any timing exists, and in the guard's probe bursts: draft at full depth, so that
            # the costs, the acceptance estimates and the guard all learn what deep drafts achieve.
            for i in free:
                depths[i] = min(self.max_depth, room[i], cap)
            self.bursting = bursting  # a burst is judged by the guard, trials or not
            return depths
        # The same batch with the same estimates gets the same plan for a few steps: the search over
        # depths costs a Python loop per request and depth, a real share of a small model's step.
        key = (
            kind,
            id(self.cost),
            other_tokens,
            tuple(depths),  # the fixed ones
            tuple((s.seq_id, min(r, self.max_depth)) for s, r in zip(seqs, room)),
            tuple(a for i in free for a in self.estimate(seqs[i]).alpha),
            tuple(seqs[i].spec_route for i in free),
        )
        reuse = self.reuse_plans if any(self._last_plan) else self.reuse_idle_plans
        if key == self._last_key and self._reused < reuse:
            self._reused += 1
            return self._explore(seqs, list(self._last_plan), free, room, other_tokens, cap)
        gains = {i: self.estimate(seqs[i]).gains(self.max_depth) for i in free}
        rates = {D: self._best_at(D, depths, free, gains, seqs, other_tokens, room) for D in range(cap + 1)}
        best = max(rates, key=lambda D: rates[D][0])
        cur = min(self.depth[kind], cap)
        if best != cur:
            self._streak[kind] = self._streak[kind] + 1 if best == self._challenger[kind] else 1
            self._challenger[kind] = best
            if rates[best][0] > rates[cur][0] * (1 + self.switch_margin) or self._streak[kind] >= self.patience:
                cur, self._streak[kind] = best, 0
        else:
            self._streak[kind] = 0
        self.depth[kind] = cur
        depths = rates[cur][1]
        self._last_key, self._last_plan, self._reused = key, tuple(depths), 0
        return self._explore(seqs, depths, free, room, other_tokens, cap)

    def _best_at(self, D, depths, free, gains, seqs, other_tokens, room) -> tuple[float, list[int]]:
        """Predicted rate and per-request depths when no request drafts deeper than ``D``."""
        trial = list(depths)
        for i in free:
            trial[i] = min(D, room[i])
        for _ in range(2):  # keep, per request, the positions whose gain beats the marginal token price
            t = self._step_time(trial, other_tokens, seqs)
            rate = (other_tokens + self._tokens(trial, seqs)) / t if t > 0 else 0.0
            price = rate * self._marginal_token_time(trial, other_tokens, seqs)
            for i in free:
                k = 0
                while k < min(D, room[i]) and gains[i][k] >= max(price, self.min_gain):
                    k += 1
                trial[i] = k
        t = self._step_time(trial, other_tokens, seqs)
        return ((other_tokens + self._tokens(trial, seqs)) / t if t > 0 else 0.0), trial

    def _explore(self, seqs, depths, free, room, other_tokens, cap) -> list[int]:
        """Exploration, at full depth, of requests the plan keeps at zero: a new request's first
        ``trial_steps`` drafts (acceptance is the text's own — a prompt that copies, one that does
        not — so it learns its own estimate rather than inheriting its population's, which may keep
        it from drafting at all), and a request idle for ``idle_probe`` steps (a better phase of its
        text, a lighter load). One token at a time would test only the first position, and lose where
        deep drafts win. A request explores only where it could pay (:meth:`_could_pay`)."""
        for i in free:
            seq = seqs[i]
            if depths[i] > 0:
                seq.spec_idle_steps = 0
                continue
            seq.spec_idle_steps += 1
            idle = seq.spec_idle_steps
            # due: an idle probe, or a trial (again just after the last; a trial that could not pay is
            # asked again ``idle_probe`` steps later, like an idle probe)
            due = idle >= self.idle_probe or (idle == 1 and self.estimate(seq).updates < self.trial_steps)
            if due and room[i] > 0 and self.budget.allows():
                full = min(self.max_depth, room[i], cap)
                if self._could_pay(i, full, depths, seqs, other_tokens):
                    depths[i] = full
                    self.exploring = True
                if depths[i] or idle >= self.idle_probe:
                    seq.spec_idle_steps = 0
        return depths

    def _could_pay(self, i, full, depths, seqs, other_tokens) -> bool:
        """Whether drafting ``full`` positions for request ``i`` (now at zero) would raise the step's
        predicted rate if its text were as predictable as texts get (``optimism`` per position).
        Where even that loses (a batch whose drafting costs more than deep drafts can return), trying
        only costs."""
        tokens = other_tokens + self._tokens(depths, seqs)
        rate = tokens / max(self._step_time(depths, other_tokens, seqs), 1e-9)
        trial = list(depths)
        trial[i] = full
        best_case = tokens + sum(self.optimism ** (j + 1) for j in range(full))
        return best_case / max(self._step_time(trial, other_tokens, seqs), 1e-9) > rate

    def _predict(self, kind: str, num_seqs: int, tokens: int) -> float:
        """``cost.predict``, memoized for one plan (which asks for the same shapes many times)."""
        key = (kind, num_seqs, tokens)
        if key not in self._memo:
            self._memo[key] = self.cost.predict(kind, num_seqs, tokens)
        return self._memo[key]

    def _tokens(self, depths: list[int], seqs: list[Sequence]) -> float:
        if not any(depths):
            return float(len(depths))
        key = ("tokens", *depths)  # one plan's batch: the same depths, the same tokens
        if key not in self._memo:
            self._memo[key] = sum(self.estimate(s).expected_tokens(d) if d else 1.0 for s, d in zip(seqs, depths))
        return self._memo[key]

    def _target_tokens(self, depths: list[int], other_tokens: int, seqs: list[Sequence]) -> int:
        slots = self.proposer.slots_for
        drafts = sum(slots(s.spec_route, d, s.params.greedy) for d, s in zip(depths, seqs) if d)
        return other_tokens + len(depths) + drafts

    def _step_time(self, depths: list[int], other_tokens: int, seqs: list[Sequence]) -> float:
        """Predicted seconds of a step: the same step without drafts, plus what drafting adds by the
        cost model's parts, scaled by how whole speculating steps have compared with that sum."""
        key = ("step", other_tokens, *depths)  # a search meets the same depths many times
        if key not in self._memo:
            plain, extra = self._step_parts(depths, other_tokens, seqs)
            self._memo[key] = plain + self.cost.spec_scale() * extra
        return self._memo[key]

    def _step_parts(self, depths: list[int], other_tokens: int, seqs: list[Sequence]) -> tuple[float, float]:
        """(seconds of the step without drafts, seconds drafting adds) by the cost model's parts."""
        n = len(depths) + (1 if other_tokens else 0)
        plain = self._predict("target", n, other_tokens + len(depths)) + self.cost.host_seconds(len(depths), 0)
        drafting = [d for d in depths if d]
        if not drafting:
            return plain, 0.0
        t = self._predict("target", n, self._target_tokens(depths, other_tokens, seqs))
        t += self.cost.host_seconds(len(depths), len(drafting))
        by_kind: dict[str, tuple[CostShape, list[int]]] = {}  # each kind of forward the drafts run, batched
        for d, seq in zip(depths, seqs):
            shape = self.proposer.cost_for(seq.spec_route)
            if d and shape.kind:
                by_kind.setdefault(shape.kind, (shape, []))[1].append(d)
        for kind, (shape, drafting) in by_kind.items():
            if shape.catch_up:  # about the root plus last step's accepted tokens
                t += self._predict(kind, len(drafting), 2 * len(drafting))
            if shape.per_level:
                for level in range(1, max(drafting)):
                    deeper = sum(1 for d in drafting if d > level)
                    t += self._predict(kind, deeper, deeper)
        return plain, max(t - plain, 0.0)

    def _marginal_token_time(self, depths: list[int], other_tokens: int, seqs: list[Sequence]) -> float:
        """What one more drafted position adds to a step: a token more in the verify, and a draft level's
        forward where the drafter runs one a level (a block drafter's one forward drafts every depth)."""
        n, m = len(depths) + 1, self._target_tokens(depths, other_tokens, seqs)
        extra = max(self._predict("target", n, m + 1) - self._predict("target", n, m), 0.0)
        shapes = (self.proposer.cost_for(s.spec_route) for s in seqs)
        for kind in {shape.kind for shape in shapes if shape.per_level} - {None}:
            extra += max(self._predict(kind, 2, 2) - self._predict(kind, 1, 1), 0.0)
        return extra

    def update(self, seq: Sequence, drafted: int, accepted: int, route: str | None = None) -> None:
        """A verified draft of ``drafted`` positions by ``route`` (None: the request's current one), of
        which ``accepted`` were kept. A lookup that found nothing to draft is a draft of one position
        that missed: what a route is expected to return counts the steps it has nothing."""
        route = route or seq.spec_route or self.routes[0]
        self._evidence += 1
        self.estimate(seq, route).update(drafted, accepted)
        self._population(route, seq).update(drafted, accepted)

    def observe_step(
        self, num_seqs: int, tokens: int, seconds: float, forward_seconds: float, num_drafting: int, batch
    ) -> None:
        """A whole step's outcome: host time for the cost model; realised tokens/s of decode-only
        steps (``batch.decode_only``) for the guard, which judges the controller's own choices: a step
        with a trial or an idle probe in it is exploration, paid for on purpose, and not judged; it,
        a burst's steps and a probation's (see Guard) are charged to the exploration budget.

        A drafting step whose proposer caught up more than a steady step can (a request's first
        drafts feed the draft its whole prompt; a probe after plain steps, all of them) teaches the
        cost model nothing about drafting's usual price: its whole-step ratio and host time are left
        out, or a few such steps would price every later draft at several times its cost."""
        ran = self.cost.take_step_tokens(self.proposer.cost_kinds())
        steady = not num_drafting or ran <= self._steady_tokens(batch)
        if steady:
            self.cost.observe_host(seconds - forward_seconds, num_seqs, num_drafting)
        if batch.decode_only:
            seqs = [s.seq for s in batch.samples]
            greedy = [s.params.greedy for s in seqs]
            members = frozenset(s.seq_id for s in seqs)
            if not (num_drafting and self.exploring):
                self.guard.observe(num_seqs, tokens, seconds, num_drafting > 0, all(greedy), members)
            explored = num_drafting and (self.exploring or self.bursting or self.on_probation)
            self.budget.observe(seconds, seconds - tokens * self._plain_token_seconds(seqs) if explored else None)
            if num_drafting and steady:  # how the whole step compared with the sum of its predicted parts
                plain, extra = self._step_parts([s.depth for s in batch.samples], 0, seqs)
                if extra > 0:
                    self.cost.observe_spec_scale((seconds - plain) / extra)

    def observe_ahead(self, seqs: list[Sequence], seconds: float) -> None:
        """A run-ahead step (engine/core/ahead.py): a plain decode step, launch and read, which gave each
        of ``seqs`` a token. Plain decoding's rate, which the guard holds speculation to, is then that
        of these steps; the cost model keeps learning from ordinary steps only (a forward ahead is not
        waited for, and its host work overlaps the device's)."""
        greedy = all(s.params.greedy for s in seqs)
        self.guard.observe(len(seqs), len(seqs), seconds, False, greedy)  # (a plain step's members: unused)
        self.budget.observe(seconds)

    def _plain_token_seconds(self, seqs: list[Sequence]) -> float:
        """Seconds a token takes by plain decoding in a batch like this one: the guard's measured
        plain rate at its size, or (none yet) the cost model's plain step."""
        rate = _rate(self.guard.bucket(len(seqs), all(s.params.greedy for s in seqs)).plain)
        if rate > 0:
            return 1.0 / rate
        return self._step_parts([0] * len(seqs), 0, seqs)[0] / len(seqs)

    def _steady_tokens(self, batch) -> int:
        """The most tokens a proposer's forwards run in a steady drafting step: per drafting sequence,
        a catch-up of its root and last step's accepted tokens, then its draft levels."""
        samples = [s for s in batch.samples if len(s.tree)]
        slots = self.proposer.slots_for
        return sum(s.depth + 1 + slots(s.seq.spec_route, s.depth, s.seq.params.greedy) for s in samples)


def profile_costs(
    cost: CostModel,
    probes: list[tuple[Callable[[list[ForwardChunk]], object], str]],
    synchronize: Callable[[], None],
    block_size: int,
    max_seqs: int,
    max_tokens: int,
    free_blocks: int,
    budget_s: float = 5.0,
) -> None:
    """Time each probe (a forward over chunks: the target's, a proposer's) over the shapes the step
    runs (sequences x tokens per sequence), seeding ``cost``; stops early past ``budget_s`` seconds."""
    ctx = 32
    deadline = time.perf_counter() + budget_s
    S = 1
    while S <= min(max_seqs, 32):
        for per in (1, 2, 4, 8, 16):
            blocks = -(-(ctx + per) // block_size)
            if S * per > max_tokens or S * blocks > free_blocks:
                continue
            chunks = [ForwardChunk([3] * per, ctx, list(range(i * blocks, (i + 1) * blocks)), per) for i in range(S)]
            for forward, kind in probes:
                for rep in range(3):
                    t0 = time.perf_counter()
                    forward(chunks)
                    synchronize()
                    if rep:
                        cost.observe(kind, S, S * per, time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                return
        S *= 2
