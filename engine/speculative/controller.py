"""Per-request draft depth, chosen each step to maximize tokens per second.

Each request keeps an estimate of its own acceptance: ``alpha[j]``, the probability that draft
position ``j`` is accepted given the positions before it were (an exponential moving average,
starting from a prior). Drafting ``k`` positions then yields, in expectation,
``1 + sum_{i<=k} prod_{j<=i} alpha[j]`` tokens from one verify step (the 1 is the recovered or
bonus token).

The cost of a step comes from measured timings (:class:`CostModel`): the target forward as a
function of the batch's token count, and the draft forwards (one catch-up forward plus one per
extra level of depth). The objective is useful tokens per second: the step's other work (prefill
chunks) plus each decoding request's expected output. For each candidate maximum depth ``D`` the
controller keeps, per request, the draft positions whose expected gain beats the marginal price of
the target time they take (the current rate times that time), and picks the ``D`` with the best
rate. With few requests the target forward costs
about the same for 1 or 8 tokens, so drafts are cheap and long; as the batch fills, every draft
token costs real target time, speculation shrinks, and at saturation it turns off (``D = 0`` is a
true bypass: no draft forward at all).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from engine.sequence import Sequence


class CostModel:
    """Seconds per forward as a function of its token count, for the target and the draft.

    Kept per power-of-two bucket of token counts (exponential moving averages), interpolated
    linearly between measured buckets and extrapolated linearly beyond them.
    """

    def __init__(self, ema: float = 0.2) -> None:
        self.ema = ema
        self.buckets: dict[str, dict[int, tuple[float, float]]] = {"target": {}, "draft": {}}  # b → (tokens, s)
        # Host-side work outside the forwards (scheduling, sampling, drafting and verification
        # bookkeeping): seconds per sequence in a plain step, and extra seconds per drafting sequence.
        self.host_per_seq: float | None = None
        self.host_per_draft: float = 0.0

    def observe_step(self, host_seconds: float, num_seqs: int, num_drafting: int) -> None:
        """What a whole step cost beyond its forwards, attributed to its sequences."""
        if num_seqs <= 0:
            return
        a = self.ema
        if num_drafting == 0:
            per = host_seconds / num_seqs
            self.host_per_seq = per if self.host_per_seq is None else (1 - a) * self.host_per_seq + a * per
        elif self.host_per_seq is not None:
            extra = max(host_seconds - self.host_per_seq * num_seqs, 0.0) / num_drafting
            self.host_per_draft = (1 - a) * self.host_per_draft + a * extra

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        b = max(0, int(math.log2(tokens)))
        old = self.buckets[kind].get(b)
        if old is None:
            self.buckets[kind][b] = (float(tokens), seconds)
        else:
            a = self.ema
            self.buckets[kind][b] = ((1 - a) * old[0] + a * tokens, (1 - a) * old[1] + a * seconds)

    def predict(self, kind: str, tokens: int) -> float:
        # A forward never gets cheaper with more tokens: noisy buckets are raised to their left neighbour.
        pts = []
        for t, sec in sorted(self.buckets[kind].values()):
            pts.append((t, max(sec, pts[-1][1]) if pts else sec))
        if not pts:
            return 0.0
        if len(pts) == 1:
            t0, s0 = pts[0]
            return s0 * max(tokens, 1) / t0 if tokens > t0 else s0
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1e-9)
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        slope = max((s1 - s0) / max(t1 - t0, 1e-9), 0.0)
        return s1 + slope * (tokens - t1)

    @property
    def ready(self) -> bool:
        return bool(self.buckets["target"]) and bool(self.buckets["draft"])


@dataclass
class AcceptanceEstimate:
    alpha: list[float]  # per draft position, P(accepted | previous accepted)
    ema: float = 0.25

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for j in range(k):
            run *= self.alpha[j]
            total += run
        return total

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from each of the first k draft positions."""
        out, run = [], 1.0
        for j in range(k):
            run *= self.alpha[j]
            out.append(run)
        return out

    def update(self, drafted: int, accepted: int) -> None:
        for j in range(min(drafted, len(self.alpha))):
            hit = 1.0 if j < accepted else 0.0
            self.alpha[j] = (1 - self.ema) * self.alpha[j] + self.ema * hit
            if not hit:
                break  # positions after the first rejection were never tested


@dataclass
class SpecController:
    max_depth: int
    slots_needed: object  # Callable[[int, bool], int]: target tokens a (greedy?) draft of this depth adds
    cost: CostModel = field(default_factory=CostModel)
    prior: float = 0.6
    min_gain: float = 0.02  # never draft a position expected to add less than this

    def __post_init__(self) -> None:
        # Population estimates (greedy / sampled requests accept very differently): a new request
        # starts from what requests like it have been accepting, not from a fixed guess.
        self.population = {g: AcceptanceEstimate([self.prior] * self.max_depth, ema=0.05) for g in (True, False)}

    def estimate(self, seq: Sequence) -> AcceptanceEstimate:
        if seq.spec_estimate is None:
            seq.spec_estimate = AcceptanceEstimate(list(self.population[seq.params.greedy].alpha))
        return seq.spec_estimate

    def plan(self, seqs: list[Sequence], other_tokens: int) -> list[int]:
        """Draft depth per decode sequence (0 = no speculation) for the coming step.

        ``other_tokens`` counts the step's non-speculative target tokens (prefill chunks etc.)."""
        fixed: dict[int, int] = {}
        free: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.speculative is False or self.max_depth == 0:
                fixed[i] = 0
            elif p.num_draft_tokens is not None:
                fixed[i] = min(p.num_draft_tokens, self.max_depth)
            else:
                free.append(i)
        depths = [fixed.get(i, 0) for i in range(len(seqs))]
        if not free or not self.cost.ready:
            for i in free:  # before any timing exists: draft at full depth, measure, then adapt
                depths[i] = self.max_depth
            return depths
        gains = {i: self.estimate(seqs[i]).gains(self.max_depth) for i in free}
        base_tokens = other_tokens + len(seqs)
        greedy = [s.params.greedy for s in seqs]
        best, best_rate = list(depths), -1.0
        for D in range(self.max_depth + 1):
            trial = list(depths)
            for i in free:
                trial[i] = D
            # Keep, per sequence, the positions whose gain beats the marginal token price at this D.
            for _ in range(2):
                t = self._step_time(trial, base_tokens, greedy)
                tokens = other_tokens + self._tokens(trial, seqs)
                rate = tokens / t if t > 0 else 0.0
                price = rate * self._marginal_token_time(trial, base_tokens, greedy)
                for i in free:
                    k = 0
                    while k < D and gains[i][k] >= max(price, self.min_gain):
                        k += 1
                    trial[i] = k
            t = self._step_time(trial, base_tokens, greedy)
            rate = (other_tokens + self._tokens(trial, seqs)) / t if t > 0 else 0.0
            if rate > best_rate * 1.0001:
                best, best_rate = trial, rate
        return best

    def _tokens(self, depths: list[int], seqs: list[Sequence]) -> float:
        return sum(self.estimate(s).expected_tokens(d) if d else 1.0 for s, d in zip(seqs, depths))

    def _step_time(self, depths: list[int], base_tokens: int, greedy: list[bool]) -> float:
        extra = sum(self.slots_needed(d, g) for d, g in zip(depths, greedy) if d)
        t = self.cost.predict("target", base_tokens + extra)
        D = max(depths, default=0)
        if D:
            drafting = [d for d in depths if d]
            t += self.cost.host_per_draft * len(drafting)
            t += self.cost.predict("draft", len(drafting) * 2)  # catch-up: about the root plus accepted
            for level in range(1, D):
                t += self.cost.predict("draft", sum(1 for d in drafting if d > level))
        return t

    def _marginal_token_time(self, depths: list[int], base_tokens: int, greedy: list[bool]) -> float:
        n = base_tokens + sum(self.slots_needed(d, g) for d, g in zip(depths, greedy) if d)
        return max(self.cost.predict("target", n + 1) - self.cost.predict("target", n), 0.0) + max(
            self.cost.predict("draft", 2) - self.cost.predict("draft", 1), 0.0
        )

    def update(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.estimate(seq).update(drafted, accepted)
        self.population[seq.params.greedy].update(drafted, accepted)


class Timer:
    """Wall time of a block; callers synchronize the device first where it matters."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
