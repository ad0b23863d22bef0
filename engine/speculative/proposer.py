"""The one interface every drafting method implements.

Every proposer gets the same inputs — the sequences to draft for, each one's draft depth, and what
the last target forward produced (hidden states of chosen layers, for heads that read them) — and
returns the same output: one :class:`DraftTree` per sequence (a chain is a tree). The engine never
branches on the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sequence import Sequence
from engine.speculative.tree import DraftTree


@dataclass
class ProposeContext:
    # layer → [T, hidden] from the last target forward, for proposers that read the target's states
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class Proposer(Protocol):
    method: str  # "draft", ... (the metrics label)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        """KV slots past the root a draft of this depth may write (verify nodes and draft-side writes),
        for a greedy or a sampling request (a proposer may draft them in different shapes)."""
        ...

    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        """Draft a tree of at most ``depths[i]`` levels for each sequence (its last token is the root)."""
        ...

    def on_verified(self, seq: Sequence, tree: DraftTree, num_accepted: int) -> None:
        """Bring the proposer's own state (e.g. its KV) in line after verification kept ``num_accepted``."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Mirror the target cache's copy-on-write block copies in the proposer's own cache, if any."""
        ...
