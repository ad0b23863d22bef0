"""State that decoding strategies keep on a sequence, defined on the floor of the sequence itself so
that :class:`~engine.request.sequence.Sequence` names its types without importing the floors above
(each strategy's logic stays with the strategy: contrastive search, no-repeat n-grams, the depth
controller)."""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class SearchState:
    """One request's search (``Sequence.search``)."""

    context: torch.Tensor | None = None  # [capacity, H] float32 unit-norm final hidden states; rows < length
    length: int = 0
    next_logits: torch.Tensor | None = None  # [V] raw logits of the next token, once it is to be chosen
    # The next token's candidates while they are fed (over one step or several):
    tokens: list[int] | None = None  # [k] best first
    probs: torch.Tensor | None = None  # [k] their probabilities
    fed: int = 0  # how many are fed (their K/V in the slots after the context)
    best: tuple | None = None  # the best fed so far: (score, candidate, [V] logits row, [1, H] final hidden)

    def start_token(self, next_logits: torch.Tensor | None) -> None:
        """On to choosing the next token (from these logits; None: not yet known), no candidate fed."""
        self.next_logits, self.tokens, self.probs, self.fed, self.best = next_logits, None, None, 0, None


class NgramIndex:
    """Every n-gram of one token history, keyed by its first ``n - 1`` tokens."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.following: dict[tuple[int, ...], set[int]] = {}
        self.indexed = 0  # tokens of the history already indexed

    def sync(self, tokens: Tokens[int]) -> None:
        """Index the n-grams ending in tokens the history gained since the last call."""
        n = self.n
        for j in range(max(self.indexed, n - 1), len(tokens)):
            self.following.setdefault(tuple(tokens[j - n + 1 : j]), set()).add(tokens[j])
        self.indexed = len(tokens)

    def banned(self, tokens: Tokens[int], path: Tokens[int] = ()) -> set[int]:
        """Tokens that may not follow ``tokens + path`` (``tokens`` already synced; ``path`` a draft
        path above a tree node, not part of the history)."""
        k = self.n - 1
        tail = list(tokens[max(len(tokens) - k, 0) :] if k else ()) + list(path)  # the history's last k, then the path
        if len(tokens) + len(path) < k:
            return set()
        key = tuple(tail[len(tail) - k :])
        out = set(self.following.get(key, ()))
        for j in range(max(len(tail) - len(path), k), len(tail)):  # n-grams ending inside the path
            if tuple(tail[j - k : j]) == key:
                out.add(tail[j])
        return out


@dataclass
class AcceptanceEstimate:
    alpha: list[float]  # per draft position, P(accepted | previous accepted)
    ema: float = 0.25
    updates: int = 0  # verified drafts seen
    found: float = 1.0  # share of the steps it was asked for a draft that it had one (a lookup may have none)

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.gains(k))

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from each of the first k draft positions."""
        out, run = [], 1.0
        for j in range(k):
            run *= self.alpha[j]
            out.append(run)
        return out

    def asked(self, drafted: bool) -> None:
        """Asked for a draft, it had one (or, a lookup with no match, none)."""
        self.found = (1 - self.ema) * self.found + self.ema * float(drafted)

    def update(self, drafted: int, accepted: int) -> None:
        self.updates += 1
        for j in range(min(drafted, len(self.alpha))):
            hit = 1.0 if j < accepted else 0.0
            self.alpha[j] = (1 - self.ema) * self.alpha[j] + self.ema * hit
            if not hit:
                break  # positions after the first rejection were never tested
