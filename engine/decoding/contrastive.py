"""Contrastive decoding: the target (the *expert*) corrected by the served draft model (the *amateur*).

Where the expert is confident and the amateur agrees, nothing changes; where the amateur alone
likes a token (the generic, repetitive continuations small models fall into), it is pushed down.
Per request ``(alpha, beta)``, with ``e`` and ``a`` the expert's and the amateur's log-probabilities
of the next token:

* *plausible* tokens: ``e >= log(alpha) + max(e)`` (the adaptive plausibility constraint: only tokens
  the expert itself finds at least ``alpha`` times as likely as its favourite may be chosen);
* contrastive logits: ``(1 + beta) * e - beta * a`` on plausible tokens, ``-inf`` elsewhere.

They replace the row's raw logits, and everything after (penalties, temperature, filters, greedy
argmax or sampling) reads them as it reads any logits. ``beta = 0`` is the expert's own distribution
restricted to plausible tokens; ``alpha = 1`` keeps only the expert's favourite (greedy decoding).
The amateur needs the same context, so every contrastive step feeds the draft model the sequence's
new tokens (one small forward for all such requests). Contrastive requests are never speculated:
their distribution is no longer the target's, and the draft model is busy being the amateur.
"""

from __future__ import annotations

import math

import torch

from engine.attention.staging import to_device

# The amateur's log-probabilities are floored here (1e-30): a token it cannot produce at all (outside
# a narrower draft vocabulary) is then very unlikely to it, not impossible, and beta = 0 never meets
# 0 * inf.
_FLOOR = math.log(1e-30)


def contrastive_logits(
    expert: torch.Tensor,  # [B, V] raw target logits
    amateur: torch.Tensor,  # [B, V] raw draft logits for the same positions
    alpha: torch.Tensor,  # [B] plausibility threshold, in (0, 1]
    beta: torch.Tensor,  # [B] contrast strength, >= 0
) -> torch.Tensor:
    """``[B, V]`` float32 contrastive logits (``-inf`` on implausible tokens)."""
    e = torch.log_softmax(expert.float(), dim=-1)
    a = torch.log_softmax(amateur.float(), dim=-1)
    plausible = e >= alpha.log().unsqueeze(1) + e.amax(dim=-1, keepdim=True)  # [B, V]
    b = beta.unsqueeze(1)
    return torch.where(plausible, (1.0 + b) * e - b * a.clamp_min(_FLOOR), float("-inf"))


def apply_contrast(logits: torch.Tensor, samples: list, proposer) -> torch.Tensor:
    """``logits`` with the rows of contrastive samples (plain samples: no draft tree) replaced by their
    contrastive logits; the amateur is the proposer's own language model. A new tensor: the raw one
    stays for the reported logprobs."""
    seqs = [s.seq for s in samples]
    amateur = proposer.next_token_logits(seqs)
    proposer.timings()  # the amateur's forwards are no draft: keep them out of the drafting cost model
    dev = logits.device
    rows = to_device([s.row for s in samples], dev, torch.int64)
    alpha, beta = to_device([s.seq.params.contrastive for s in samples], dev, torch.float32).unbind(-1)
    shaped = logits.clone()
    shaped[rows] = contrastive_logits(logits.index_select(0, rows), amateur.to(dev), alpha, beta)
    return shaped
