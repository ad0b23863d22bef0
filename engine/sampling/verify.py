"""Lossless verification of draft trees: a pure function over flat tensors for the whole batch.

Terms (p: target, q: draft):

- *accepted* token: a draft node the target keeps. Walking down from the root, the children of the
  current node are tried in order. A child ``x`` drafted by *sampling* from ``q`` is accepted with
  probability ``min(1, p(x) / q(x))``; on rejection ``p`` becomes the normalized residual
  ``max(0, p − q)``. A child chosen *deterministically* (argmax, top-k) has ``q`` one-hot at ``x``: it
  is accepted with probability ``p(x)``, and on rejection ``x`` is removed from ``p`` (``max(0, p − q)``
  again). Either way the next sibling is tried against the updated residual.
- *recovered* token: when every child of the current node is rejected (or it has none), one token is
  sampled from the current residual, and the walk ends.
- *bonus* token: the recovered token at a leaf, where nothing was rejected: a plain sample of ``p``.

Each step of the walk returns exactly the target's distribution (for deterministic children this is
sampling ``p`` one candidate at a time without replacement), so the emitted tokens are distributed
exactly as plain sampling from the target. Greedy rows have ``p`` one-hot, so this reduces to: keep
the child equal to the target's argmax, and emit the argmax — plain greedy decoding, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.staging import ring
from engine.runner.readback import to_host


@dataclass
class VerifyInput:
    p: torch.Tensor  # [R, V] target sampling distribution at every row (each sequence: root, then nodes)
    row_tokens: torch.Tensor  # [R] int64 draft token of each row (roots: ignored)
    children: torch.Tensor  # [R, C] int64 global rows of each row's children, best first; -1 pads
    roots: torch.Tensor  # [B] int64 the root row of each sequence
    max_depth: int  # deepest node of any tree (0: no drafts at all)
    q: torch.Tensor | None = None  # [R, V] draft distribution a sampled row was drawn from
    sampled: torch.Tensor | None = None  # [R] bool: row was sampled from q (else deterministic)


@dataclass
class VerifyOutput:
    accepted_rows: list[list[int]]  # per sequence, rows of the accepted nodes, root to leaf
    final_tokens: list[int]  # per sequence, the recovered or bonus token


def _randoms(B: int, n_uniform: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, n] for the accept tests and [B] float64 ones for the final draws (unseeded
    requests only: seeded ones are verified by ``accept_seeded``, with keyed noise)."""
    u = torch.rand(B, max(n_uniform, 1), device=device)
    return u, torch.rand(B, dtype=torch.float64, device=device)


def draw(P: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``P`` ``[B, V]`` (non-negative, unnormalized, every row with mass) by its
    inverse CDF at ``u`` ``[B]`` (float64 uniforms in [0, 1)): the first token whose running sum
    exceeds ``u`` times the row's total. Token ``i`` is drawn with probability ``P[i] / sum(P)`` up
    to the float64 rounding of the sums, and a token without mass never is: the point is kept
    strictly below the total, and a token is found only where the running sum steps up.

    One uniform and one running sum a row: a CPU draws the race's ``V`` exponentials
    (``argmax(P / E)``) at ~15 ns each (66 us a row at V = 4,096, 2 ms at 128K); this is 2.5 to 22
    times cheaper, the most for several rows (docs/benchmarks.md)."""
    cdf = P.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    point = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]


def drop_token(P: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting a deterministic draft ``x`` (q one-hot): ``x`` removed from ``p``."""
    return P.scatter(1, x[:, None], 0.0)


def reject_residual(P: torch.Tensor, q_rows: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting a draft drawn from ``q``: ``max(0, p − q)`` (p normalized first)."""
    return (P / P.sum(-1, keepdim=True)).sub_(q_rows).clamp_(min=0.0)


def verify(inp: VerifyInput) -> VerifyOutput:
    p, children, roots = inp.p, inp.children, inp.roots
    B, C = roots.shape[0], children.shape[1]
    if C == 1:
        return verify_chains(inp)
    device = p.device
    # One final draw per sequence, at the depth where its walk ends: one uniform each serves every depth.
    u, uf = _randoms(B, (inp.max_depth + 1) * C, device)
    cur = roots.clone()
    alive = torch.ones(B, dtype=torch.bool, device=device)
    P = p[cur].clone()  # the current residual, unnormalized
    final = torch.zeros(B, dtype=torch.int64, device=device)
    accepted_by_depth = []
    k = 0
    for _depth in range(inp.max_depth + 1):
        took = torch.zeros(B, dtype=torch.bool, device=device)
        nxt = cur.clone()
        for c in range(C):
            child = children[cur, c]
            trying = alive & ~took & (child >= 0)
            row = child.clamp(min=0)
            x = inp.row_tokens[row]
            norm = P.sum(-1)
            px = P.gather(1, x[:, None])[:, 0] / norm.clamp(min=1e-30)
            if inp.q is not None:
                qx = inp.q[row].gather(1, x[:, None])[:, 0]
                is_sampled = inp.sampled[row]
                ratio = torch.where(is_sampled, torch.clamp(px / qx.clamp(min=1e-30), max=1.0), px)
            else:
                ratio = px
            acc = trying & (u[:, k] < ratio)
            k += 1
            rej = trying & ~acc
            # Rejected deterministic draft: drop its token. Rejected sampled draft: residual max(0, p - q).
            zero_x = drop_token(P, x)
            if inp.q is not None:
                residual = torch.where(is_sampled[:, None], reject_residual(P, inp.q[row]), zero_x)
            else:
                residual = zero_x
            P = torch.where(rej[:, None], residual, P)
            took |= acc
            nxt = torch.where(acc, child, nxt)
        # Sequences that kept no child end here with a recovered (or bonus) token from the residual.
        ending = alive & ~took
        empty = P.sum(-1, keepdim=True) <= 0  # only by rounding: fall back to p itself
        dist = torch.where(empty, p[cur], P)
        final = torch.where(ending, draw(dist, uf), final)
        accepted_by_depth.append(torch.where(took, nxt, torch.full_like(nxt, -1)))
        alive &= took
        cur = nxt
        P = torch.where(took[:, None], p[cur], P)
    rows, final_host = to_host(torch.stack(accepted_by_depth, 1), final)  # one transfer
    return VerifyOutput([[r for r in seq_rows if r >= 0] for seq_rows in rows], final_host)


def verify_chains(inp: VerifyInput) -> VerifyOutput:
    """:func:`verify` where every tree is a chain (a row has one child at most), in one pass instead of
    a walk: with no siblings, each node's test reads its parent's ``p`` alone, so every test is drawn
    at once, the walk's end is the first rejection (or the leaf), and one draw from that row's
    residual (or ``p`` at the leaf: the bonus token) ends it. Same rules and residuals as the walk."""
    p, roots, D = inp.p, inp.roots, inp.max_depth
    R, B, device = p.shape[0], roots.shape[0], p.device
    n = torch.diff(roots, append=roots.new_tensor([R])) - 1  # [B] nodes per chain (rows: root, nodes)
    node = (roots[:, None] + 1 + torch.arange(D, device=device)).clamp(max=R - 1)  # [B, D] row of depth d + 1
    x = inp.row_tokens[node]
    px = p[node - 1, x] / p.sum(-1).clamp(min=1e-30)[node - 1]  # each node's p, at its parent's row
    if inp.q is not None:
        ratio = torch.where(inp.sampled[node], (px / inp.q[node, x].clamp(min=1e-30)).clamp(max=1.0), px)
    else:
        ratio = px
    u, uf = _randoms(B, D, device)
    kept = (u[:, :D] < ratio) & (torch.arange(D, device=device) < n[:, None])
    a = kept.long().cumprod(1).sum(1)  # [B] accepted nodes: those before the first rejection
    last = roots + a  # the row the walk ends at
    P = p[last]
    rej = (last + 1).clamp(max=R - 1)  # the rejected node's row, where a < n
    residual = drop_token(P, inp.row_tokens[rej])
    if inp.q is not None:
        residual = torch.where(inp.sampled[rej][:, None], reject_residual(P, inp.q[rej]), residual)
    P = torch.where((a < n)[:, None], residual, P)
    P = torch.where(P.sum(-1, keepdim=True) <= 0, p[last], P)  # only by rounding: fall back to p itself
    host = torch.cat([a, draw(P, uf), roots]).tolist()  # one transfer
    a_, final, root = host[:B], host[B : 2 * B], host[2 * B :]
    return VerifyOutput([list(range(r + 1, r + 1 + k)) for r, k in zip(root, a_)], final)


def build_verify_input(
    p: torch.Tensor,  # [R, V]
    trees: list,  # list[DraftTree], one per sequence; rows are laid out root, node 0, node 1, ... per tree
    vocab_size: int,
) -> tuple[VerifyInput, list[int]]:
    """Flatten per-sequence trees into a :class:`VerifyInput`; also returns each tree's root row."""
    device = p.device
    roots, tokens, child_lists, q_rows, sampled = [], [], [], [], []
    row = 0
    max_depth = 0
    any_q = any(t.q is not None for t in trees)
    for t in trees:
        roots.append(row)
        n = len(t)
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        depth = [0] * (n + 1)
        for i, par in enumerate(t.parents):
            kids[par + 1].append(row + i + 1)
            depth[i + 1] = depth[par + 1] + 1
        max_depth = max(max_depth, max(depth))
        tokens.append(-1)
        tokens.extend(t.tokens)
        child_lists.extend(kids)
        if any_q:
            sampled.extend([False] + [t.q is not None] * n)
            q_rows.append(torch.zeros(1, vocab_size, device=device))
            q_rows.append(t.q if t.q is not None else torch.zeros(n, vocab_size, device=device))  # q: on the device
        row += n + 1
    C = max(1, max(len(k) for k in child_lists))
    table = np.full((row, C), -1, dtype=np.int64)
    for r, kids in enumerate(child_lists):
        if kids:
            table[r, : len(kids)] = kids
    # one copy from the pinned ring (lists sent one by one would each wait for the device)
    row_tokens, children, roots_t, sampled_t = ring(device).send(
        [np.maximum(np.asarray(tokens, dtype=np.int64), 0), table, np.asarray(roots, dtype=np.int64),
         np.asarray(sampled, dtype=np.bool_)]
    )  # fmt: skip
    inp = VerifyInput(
        p=p,
        row_tokens=row_tokens,
        children=children,
        roots=roots_t,
        max_depth=max_depth,
        q=torch.cat(q_rows) if any_q else None,
        sampled=sampled_t if any_q else None,
    )
    return inp, roots


def greedy_accept(targets: list[int], trees: list, roots: list[int]) -> list[tuple[list[int], int]]:
    """Verification when every row is greedy: ``targets[r]`` is the target's argmax at row ``r``.

    Walking down from each root, keep the child whose token equals the argmax at its parent's row;
    the argmax where the walk stops is the recovered (or bonus) token. This is :func:`verify` for a
    one-hot ``p`` without building any ``[R, V]`` tensor. Returns ``(accepted node indices, final
    token)`` per tree.
    """
    out = []
    for tree, root in zip(trees, roots):
        kids: dict[int, list[int]] = {}
        for i, par in enumerate(tree.parents):
            kids.setdefault(par, []).append(i)
        node, accepted = -1, []
        while True:
            want = targets[root + node + 1]
            nxt = next((c for c in kids.get(node, ()) if tree.tokens[c] == want), None)
            if nxt is None:
                out.append((accepted, want))
                break
            accepted.append(nxt)
            node = nxt
    return out
