"""A draft tree is a small value: tokens and parent indices, in topological order.

Node ``i`` holds ``tokens[i]`` and hangs under ``parents[i]`` (``-1`` = the root, which is the
sequence's last sampled token, not yet in the target's cache). A chain is a tree whose node ``i``
hangs under ``i - 1``. Siblings are listed best first (the order verification tries them in).

:func:`tree_layout` turns a tree into what a verify forward needs, for rows ``[root, node 0, …]``:
the attention mask among them (none for a chain: causal), their depths (positions are
``ctx_len + depth``), and each row's children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = the root; parents[i] < i
    # [n, vocab] draft distribution each node was *sampled* from, or None when the nodes were chosen
    # deterministically (argmax / top-k): verification then treats q as one-hot at the token.
    q: torch.Tensor | None = None
    # The proposer that drafted it, where an engine holds several (``--speculative-method auto``):
    # the acceptance it earns is that proposer's, for that request. "" = the engine's one proposer.
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None, source: str = "") -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q, source)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Levels below the root (0 for an empty tree)."""
        levels: list[int] = []
        for p in self.parents:
            levels.append(levels[p] + 1 if p >= 0 else 1)
        return max(levels, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


@dataclass
class TreeLayout:
    mask: torch.Tensor | None  # [n + 1, n + 1] bool: row r may attend to row c (root = row 0); None: causal
    depths: list[int]  # [n + 1], root 0
    children: list[list[int]]  # [n + 1] rows of each row's children, best first


def tree_layout(tree: DraftTree) -> TreeLayout:
    n = len(tree)
    if tree.is_chain:  # rows [root, node 0, …] are a causal chunk: no mask to build or apply
        return TreeLayout(None, list(range(n + 1)), [[r + 1] for r in range(n)] + [[]])
    depths = [0] * (n + 1)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, p in enumerate(tree.parents):
        r, pr = i + 1, p + 1  # rows: node i is row i + 1
        depths[r] = depths[pr] + 1
        children[pr].append(r)
        mask[r] = mask[pr]
        mask[r, r] = True
    return TreeLayout(mask, depths, children)


def accepted_path_rows(tree: DraftTree, num_accepted: int, last_row: int) -> list[int]:
    """Rows of the accepted path ending at ``last_row`` (excluding the root), root to leaf."""
    path = []
    r = last_row
    while r > 0:
        path.append(r)
        r = tree.parents[r - 1] + 1
    path.reverse()
    assert len(path) == num_accepted
    return path
