"""Confidence-based early stopping of drafts, with a threshold that adapts to acceptance.

Draft & Verify (Zhang et al., 2023) observed that a draft's own top-1 probability predicts whether
the target will accept its token: a model-based drafter stops extending a draft as soon as that
confidence falls below a threshold ``gamma``, saving the draft forwards (and the verify slots) that
would most likely be rejected. ``gamma`` is not fixed: when the tokens that were drafted are
accepted less often than a target rate, it rises (draft only confident tokens); when they are
accepted more often, it falls (draft deeper).

The first level is always drafted: the drafter's forward at the root has been paid for already (a
catch-up, or the root forward of layer skipping), so a level-1 token costs only its verify slot — and
every draft is then verified, so ``gamma`` keeps learning (a threshold that stopped every draft at
the root would never hear of acceptance again and could never come down).

Division of labour with the controller: the controller chooses the *most* levels a request may
draft this step from its acceptance history and the measured costs; early stopping ends a draft
before that when the drafter is unsure *now*. The controller is told the depth that was really
drafted (``Sample.depth``), so positions a draft never reached do not count against it.

Greedy and sampling requests accept at very different rates, so each keeps its own threshold.
"""

from __future__ import annotations

import torch

from engine.attention.staging import to_device


class EarlyStop:
    """``gamma`` per kind of request (greedy / sampling), moved by the observed acceptance rate.

    After each verified draft the acceptance rate ``accepted / drafted`` feeds an exponential moving
    average; if the average is below ``target`` the threshold rises by ``step``, else it falls by
    ``step``, within ``[0, ceiling]`` (a ceiling below 1 lets the most confident drafts through).
    It starts at 0 — drafts as deep as the controller allows — until acceptance says otherwise."""

    def __init__(
        self, target: float, start: float = 0.0, step: float = 0.05, ema: float = 0.3, ceiling: float = 0.95
    ) -> None:
        if not 0.0 < target < 1.0:
            raise ValueError(f"the early-stop target acceptance rate must be in (0, 1), got {target}")
        self.target, self.step, self.ema, self.ceiling = target, step, ema, ceiling
        self.gamma = {True: start, False: start}  # greedy → threshold
        self.rate = {True: target, False: target}  # greedy → moving average of the acceptance rate

    def thresholds(self, greedy: list[bool], device: torch.device) -> torch.Tensor:
        """``[B]`` the threshold of each row's kind."""
        return to_device([self.gamma[g] for g in greedy], device, torch.float32)

    def observe(self, greedy: bool, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        r = (1 - self.ema) * self.rate[greedy] + self.ema * accepted / drafted
        self.rate[greedy] = r
        g = self.gamma[greedy] + (self.step if r < self.target else -self.step)
        self.gamma[greedy] = min(max(g, 0.0), self.ceiling)


def early_stop_for(config, default: float | None) -> EarlyStop | None:
    """The engine config's early stop (``spec_early_stop``: a target acceptance rate, 0 = off, None =
    the method's ``default``)."""
    target = default if config.spec_early_stop is None else config.spec_early_stop
    return EarlyStop(target) if target else None


def draft_confidence(logits: torch.Tensor, q: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
    """``[B]`` the drafter's top-1 probability per row: of the distribution a sampling row draws
    from (``q``, ``[B, V]``), and of ``softmax(logits)`` for a greedy row (whose ``q`` is one-hot)."""
    if not any(greedy):
        return q.amax(-1)
    top = torch.softmax(logits.float(), -1).amax(-1)
    if all(greedy):
        return top
    return torch.where(to_device(greedy, q.device, torch.bool), top, q.amax(-1))
