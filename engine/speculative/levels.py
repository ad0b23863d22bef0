"""Drafting level by level: the tree shapes every model-based proposer shares.

A :class:`LevelDrafter` has two model hooks: ``_root_logits`` (the drafter's distribution over level
1, one row per sequence whose root it reached) and ``_level`` (feed tokens still on the device, each
with the state of the row it hangs under, and get their children's logits and states). What the
*state* is belongs to the method: nothing for a draft model or layer skipping (their KV carries the
context), the drafter's own hidden state for EAGLE and chained heads. This class turns the hooks
into the three draft shapes, without waiting for the host between levels; one transfer at the end
builds the trees:

- *chains*: ``K`` tokens; greedy requests take the argmax, sampled ones sample from the draft
  distribution ``q`` shaped by the request's own parameters (kept for rejection sampling);
- *greedy trees* (EAGLE-2-style dynamic expansion): each level expands the ``topk`` nodes with the
  highest cumulative draft log-probability into their ``topk`` best children; finally all nodes are
  reranked by cumulative log-probability and the best ``budget`` kept (an ancestor always outranks
  its descendants, so the kept set is a tree). Nodes are deterministic: ``q`` is one-hot.
- *sampled trees*: each level draws ``topk`` distinct children of the spine node *without
  replacement* from ``q`` (the exponential race), and the first of them continues the spine. The
  ``i``-th sibling's row carries the distribution it was really drawn from — ``q`` without the
  earlier siblings, renormalized — so recursive rejection sampling stays exact.

Draft & Verify's confidence exit (``early_stop``) cuts a sequence's draft short where the drafter
is unsure (see ``engine/speculative/early_stop.py``); the first level is always drafted.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from engine.attention.staging import to_device
from engine.request.sequence import Sequence
from engine.runner.model_runner import chain_pick
from engine.runner.readback import to_host
from engine.runner.timing import Lap
from engine.sampling.sampler import SamplingMetadata, compute_probs, exponential_noise, processed
from engine.sampling.tree import DraftTree
from engine.speculative.early_stop import EarlyStop, draft_confidence
from engine.speculative.proposer import ProposeContext, Proposer


def draw_siblings(q: torch.Tensor, noise: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` distinct tokens drawn without replacement from each row of ``q`` ``[A, V]`` by the exponential
    race against ``noise`` (Exp(1), ``[A, V]``): the tokens ``[A, k]`` in the order drawn, and the
    distribution each was really drawn from ``[A, k, V]`` (``q`` without the earlier ones, renormalized),
    which recursive rejection sampling divides by."""
    order = (q / noise).topk(k, dim=-1).indices  # [A, k]
    taken = torch.zeros_like(q, dtype=torch.bool)
    qs = []
    for i in range(k):
        qi = q.masked_fill(taken, 0.0)
        qs.append(qi / qi.sum(-1, keepdim=True).clamp_min(1e-30))
        taken.scatter_(1, order[:, i : i + 1], True)
    return order, torch.stack(qs, 1)


def _rows(state: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if state is None else state[idx]


class LevelDrafter(Proposer):
    """A proposer that drafts chains and trees level by level from a model (see the module doc)."""

    # A drafter that can run several levels of chains (no state, no logits processing) in one call
    # sets this and implements _chain_levels; the second also lets sampled chains (at a temperature
    # alone) run so.
    fuses_chains = False
    fuses_sampled_chains = False

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        tree: bool,
        topk: int = 2,
        budget: int = 16,
        early_stop: EarlyStop | None = None,
    ) -> None:
        if topk < 1 or budget < 1:
            raise ValueError("spec tree topk and budget must be positive")
        self.vocab_size = vocab_size  # the target's: draft distributions are over its ids
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.tree = tree
        self.topk = topk
        self.budget = budget
        self.early_stop = early_stop  # Draft & Verify's confidence exit (None: draft the planned depth)
        # (cost kind, sequences, tokens, lap, forwards it spans): read at timings(), once the drafts'
        # tokens have reached the host (engine/runner/timing.py)
        self._timings: list[tuple[str, int, int, Lap, int]] = []
        # seq_id → node indices of this step's tree whose tokens were fed at their final slot
        # (root + 1 + i for the i-th of them): a drafter with its own KV keeps them if accepted.
        self._written: dict[int, list[int]] = {}

    # -- the model hooks ------------------------------------------------------------------------
    @abstractmethod
    def _root_logits(
        self, seqs: list[Sequence], ctx: ProposeContext
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The indices of the sequences whose root the drafter reached this step, its logits there
        ``[len(ready), V]`` (the target's vocabulary) and their states (or None)."""

    @abstractmethod
    def _level(
        self,
        seqs: list[Sequence],
        ids: torch.Tensor,  # [A, per_seq] tokens still on the device
        per_seq: int,
        first: list[int],
        depth: int,
        masks: list[torch.Tensor] | None = None,  # per sequence [per_seq, first + per_seq] ancestor mask
        state: torch.Tensor | None = None,  # [A * per_seq, ...] the state of each token's parent row
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``per_seq`` tokens per sequence as tree nodes at depth ``depth`` (draft slots
        ``root + 1 + first[b] ...``); returns their children's logits ``[A * per_seq, V]`` and states."""

    def _chain_levels(
        self, seqs: list[Sequence], ids: torch.Tensor, levels: int, temperature=None, noise=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``levels`` levels of chains, ``ids`` ``[A]`` (on the device) feeding the first at draft slot
        ``root + 1``; returns each level's token ``[A, levels]``: the argmax, or with a ``temperature``
        ``[A]`` a draw from ``q = softmax(logits / T)`` against ``noise[level]`` (``[levels, A, V]``
        Exp(1)), with those ``q`` ``[A, levels, V]`` (see ``ModelRunner.chain``). This one feeds
        them one :meth:`_level` forward each; a drafter with ``fuses_chains`` runs them in one call."""
        out, qs = [], []
        for d in range(levels):
            logits, _ = self._level(seqs, ids, 1, [d] * len(seqs), d + 1)
            ids, q = chain_pick(logits, temperature, None if noise is None else noise[d])
            out.append(ids)
            qs.append(q)
        return torch.stack(out, 1), None if noise is None else torch.stack(qs, 1)

    # -- shape ----------------------------------------------------------------------------------
    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        if depth <= 0:
            return 0
        if not self.tree:
            return depth
        k = self.topk
        if not greedy:
            return k * depth  # k siblings per level; the draft writes one spine node per level
        nodes = min(self.budget, k + (depth - 1) * k * k)
        return max(nodes, (depth - 1) * k)  # the draft writes k nodes per level past the first

    def observe_acceptance(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        """Move the early-stop threshold by how much of the drafted depth the target accepted."""
        if self.early_stop is not None and len(tree):
            self.early_stop.observe(seq.params.greedy, tree.depth, len(accepted))

    def on_free(self, seq: Sequence) -> None:
        self._written.pop(seq.seq_id, None)

    def timings(self) -> list[tuple[str, int, int, float]]:
        laps, self._timings = self._timings, []
        return [(kind, s, t, lap.seconds / n) for kind, s, t, lap, n in laps for _ in range(n)]

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        ready, logits, state = self._root_logits(seqs, ctx)
        out = [DraftTree() for _ in seqs]
        groups = {True: [], False: []}
        for j, i in enumerate(ready):
            groups[self.tree and seqs[i].params.greedy].append((i, j))
        for as_tree, members in groups.items():
            if members:
                idx = to_device([j for _, j in members], logits.device, torch.int64)
                draft = self._greedy_trees if as_tree else self._sampled
                seqs_, depths_ = [seqs[i] for i, _ in members], [depths[i] for i, _ in members]
                for (i, _), tree in zip(members, draft(seqs_, depths_, logits[idx], _rows(state, idx))):
                    out[i] = tree
        return out

    def _sure(self, logits: torch.Tensor, q: torch.Tensor, greedy: list[bool]) -> list[int]:
        """Rows (of ``[A, V]`` draft logits and their ``q``) whose top-1 draft probability reaches
        their early-stop threshold (one small transfer: the rows that go on drafting)."""
        conf = draft_confidence(logits, q, greedy)
        return [a for a, ok in enumerate((conf >= self.early_stop.thresholds(greedy, conf.device)).tolist()) if ok]

    def _sure_levels(self, logp: torch.Tensor, rows: list[int]) -> list[int]:
        """Greedy trees: the sequences of ``rows`` (``logp[a]``: top-1 log q of each node the row
        would extend) where some node's child reaches the greedy threshold."""
        ok = (logp.amax(-1).exp() >= self.early_stop.gamma[True]).tolist()
        return [b for b, sure in zip(rows, ok) if sure]

    def _sampled(
        self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor, state: torch.Tensor | None
    ) -> list[DraftTree]:
        """Chains (``topk`` 1 or greedy requests in chain mode) and sampled trees: one spine token per
        level is fed back; sampled trees add ``topk - 1`` distinct siblings per level as leaves."""
        B, D = len(seqs), max(depths)
        k = self.topk if self.tree else 1
        md = SamplingMetadata.from_state(
            [s.params for s in seqs],
            [s.num_output_tokens for s in seqs],
            [s.token_counts for s in seqs],
            [s.prompt_mask for s in seqs],
            [s.noise_key() for s in seqs],
            self.eos_token_ids,
            self.vocab_size,
            self.device,
        )
        if self.fuses_chains and k == 1 and state is None and self.early_stop is None and not md.needs_processing:
            temperature_only = md.all_random and md.top_k is None and md.top_p is None and md.min_p is None
            if md.all_greedy or (temperature_only and self.fuses_sampled_chains):
                return self._fused_chains(seqs, depths, logits, md)
        level_rows: list[dict[int, int]] = []  # per level: sequence index → its row at that level
        level_tokens: list[torch.Tensor] = []  # [A, k] per level
        level_q: list[torch.Tensor | None] = []  # [A, k, V] per level, each sibling's q (None: greedy chains)
        rows, cur = list(range(B)), logits
        fed = [0] * B  # spine tokens fed back per sequence (at their final slots)
        for d in range(D):
            mdl = md.select(rows)
            cur = processed(cur, mdl)
            if k == 1 and mdl.all_greedy and self.early_stop is None:
                order, qs = cur.argmax(-1, keepdim=True), None  # greedy chains: q is one-hot there, read by nothing
            else:
                rows, cur, order, qs, state = self._draw(seqs, rows, cur, md, mdl, d, k, state)
                if not rows:
                    break
            at = {b: a for a, b in enumerate(rows)}
            level_rows.append(at)
            level_tokens.append(order)
            level_q.append(qs)
            nxt = [b for b in rows if depths[b] > d + 1]
            if not nxt:
                break
            keep = to_device([at[b] for b in nxt], cur.device, torch.int64)
            spine = order[keep, 0]
            cur, state = self._level([seqs[b] for b in nxt], spine, 1, [d] * len(nxt), d + 1, None, _rows(state, keep))
            for b in nxt:
                fed[b] += 1
            rows = nxt
        # One transfer: tokens and the probability each sibling had, for every level.
        with_p = [d for d, q in enumerate(level_q) if q is not None]
        host = to_host(*level_tokens, *(level_q[d].gather(2, level_tokens[d][..., None]) for d in with_p))
        tok_host, p_host = host[: len(level_tokens)], [None] * len(level_q)
        for d, p in zip(with_p, host[len(level_tokens) :]):
            p_host[d] = p
        trees = []
        for b in range(B):
            toks, parents, qrows, spine_node, spine = [], [], [], -1, []
            for d, at in enumerate(level_rows):
                if b not in at:
                    break
                a = at[b]
                first = len(toks)
                for i in range(k):
                    if i > 0 and p_host[d][a][i][0] <= 0.0:
                        continue  # fewer than k tokens have mass (top-k / top-p): no such sibling
                    toks.append(tok_host[d][a][i])
                    parents.append(spine_node)
                    if level_q[d] is not None:
                        qrows.append(level_q[d][a, i])
                spine_node = first
                spine.append(first)
            q = torch.stack(qrows) if qrows and not seqs[b].params.greedy else None  # [n, V]
            trees.append(DraftTree(toks, parents, q))
            self._written[seqs[b].seq_id] = spine[: fed[b]]
        return trees

    def _fused_chains(self, seqs, depths: list[int], logits: torch.Tensor, md: SamplingMetadata) -> list[DraftTree]:
        """Chains whose levels past the first run in one call per depth (see :meth:`_chain_levels`):
        the first token from the root logits, as :meth:`_draw` takes it (the argmax, or a draw from
        ``q`` with the noise of the request's key for that level), then ``depth - 1`` more."""
        greedy = md.all_greedy
        if greedy:
            q0, first = None, logits.argmax(-1)
        else:
            q0 = compute_probs(logits, md)  # [B, V]: softmax(logits / T), nothing else applies
            first = (q0 / exponential_noise(q0, [s.noise_key(0) for s in seqs])).argmax(-1)
        by_depth: dict[int, list[int]] = {}
        for b, d in enumerate(depths):
            by_depth.setdefault(d, []).append(b)
        deeper = []
        for d, members in by_depth.items():
            if d > 1:
                idx = to_device(members, first.device, torch.int64)
                group = [seqs[b] for b in members]
                temperature = noise = None
                if not greedy:  # each level's noise from the request's key for that level, as _draw's
                    temperature = md.temperature[idx]
                    keys = [[s.noise_key(j) for s in group] for j in range(1, d)]
                    noise = torch.stack([exponential_noise(q0[idx], level) for level in keys])
                deeper.append((members, *self._chain_levels(group, first[idx], d - 1, temperature, noise)))
        first_host, *rest_host = to_host(first, *(rest for _, rest, _ in deeper))  # one transfer
        tokens = [[t] for t in first_host]
        qs: list[list[torch.Tensor]] = [[] if greedy else [q0[b : b + 1]] for b in range(len(seqs))]
        for (members, _, q), rest in zip(deeper, rest_host):
            for j, (b, row) in enumerate(zip(members, rest)):
                tokens[b] += row
                if q is not None:
                    qs[b].append(q[j])
        trees = []
        for seq, toks, q in zip(seqs, tokens, qs):
            trees.append(DraftTree(toks, list(range(-1, len(toks) - 1)), None if greedy else torch.cat(q)))
            self._written[seq.seq_id] = list(range(len(toks) - 1))  # every token but the last was fed
        return trees

    def _draw(self, seqs, rows, cur, md, mdl, d, k, state):
        """Level ``d + 1``'s tokens for the sequences ``rows`` (``cur``: their draft logits ``[A, V]``,
        processed): the rows that go on (the confidence exit may drop some), their logits, the drawn
        tokens ``[A, k]``, the distribution each was drawn from ``[A, k, V]``, and their states."""
        q = compute_probs(cur, mdl)  # [A, V]
        if self.early_stop is not None and d > 0:  # rows whose drafter is unsure stop before this level
            sure = self._sure(cur, q, [seqs[b].params.greedy for b in rows])
            if len(sure) < len(rows):
                if not sure:
                    return [], cur, None, None, state
                idx = to_device(sure, cur.device, torch.int64)
                rows, cur, q, state = [rows[a] for a in sure], cur[idx], q[idx], _rows(state, idx)
                mdl = md.select(rows)
        # A seeded request drafts with the noise its verification samples the same position with
        # (coupled draws: the draft is kept whenever its choice is also the target's).
        noise = [seqs[b].noise_key(d) if not seqs[b].params.greedy else None for b in rows]
        if k == 1:
            order = (q if mdl.all_greedy else q / exponential_noise(q, noise)).argmax(-1, keepdim=True)
            return rows, cur, order, q[:, None], state
        return rows, cur, *draw_siblings(q, exponential_noise(q, noise), k), state

    def _greedy_trees(
        self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor, state: torch.Tensor | None
    ) -> list[DraftTree]:
        k, B, D = self.topk, len(seqs), max(depths)
        dev = logits.device
        score, tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k] level 1
        rows = list(range(B))
        # per level: (sequence index → its row, tokens, scores, parent ids)
        levels = [({b: b for b in rows}, tok, score, torch.full_like(tok, -1))]
        f_ids = torch.arange(k, device=dev).expand(B, k)  # frontier node ids
        f_tok, f_score, f_run = tok, score, None  # frontier tokens, scores, parents' run rows
        # the frontier nodes' parents' states [B, k, ...]: level 1 hangs under the root
        f_state = None if state is None else state[:, None].expand(B, k, *state.shape[1:])
        run_max = max(D - 1, 1) * k
        anc = torch.zeros(B, run_max, run_max, dtype=torch.bool, device=dev)  # run row → its ancestors' run rows
        for level in range(2, D + 1):
            nxt = [b for b in rows if depths[b] >= level]
            if not nxt:
                break
            at = {b: a for a, b in enumerate(rows)}
            keep, seq_rows = to_device([[at[b] for b in nxt], nxt], dev, torch.int64)
            f_ids, f_tok, f_score, f_state = f_ids[keep], f_tok[keep], f_score[keep], _rows(f_state, keep)
            first = (level - 2) * k  # run rows of the frontier fed now
            new = torch.arange(first, first + k, device=dev)
            sub = anc[seq_rows]  # [A, R, R]
            if f_run is not None:
                sub[:, first : first + k] = sub.gather(1, f_run[keep][:, :, None].expand(-1, -1, run_max))
            sub[:, new, new] = True
            anc[seq_rows] = sub
            masks = [sub[a, first : first + k, : first + k] for a in range(len(nxt))]
            fed_state = None if f_state is None else f_state.flatten(0, 1)
            fed = [seqs[b] for b in nxt]
            logits, out_state = self._level(fed, f_tok, k, [first] * len(nxt), level - 1, masks, fed_state)
            out_state = None if out_state is None else out_state.view(len(nxt), k, *out_state.shape[1:])
            child = torch.log_softmax(logits.float(), -1)
            cv, ci = child.view(len(nxt), k, -1).topk(k, dim=-1)  # [A, k, k]
            if self.early_stop is not None:  # a row stops when no frontier node has a confident child
                sure = self._sure_levels(cv[:, :, 0], nxt)
                if len(sure) < len(nxt):
                    if not sure:
                        break
                    at = {b: a for a, b in enumerate(nxt)}
                    keep = to_device([at[b] for b in sure], dev, torch.int64)
                    cv, ci, f_ids, f_score = cv[keep], ci[keep], f_ids[keep], f_score[keep]
                    out_state = _rows(out_state, keep)
                    nxt = sure
            c_score = (f_score[:, :, None] + cv).flatten(1)  # [A, k*k] cumulative log q
            c_tok = ci.flatten(1)
            c_par = f_ids.repeat_interleave(k, dim=1)
            levels.append(({b: a for a, b in enumerate(nxt)}, c_tok, c_score, c_par))
            f_score, sel = c_score.topk(k, dim=-1)
            base = k + (level - 2) * k * k
            f_ids, f_tok, f_run = base + sel, c_tok.gather(1, sel), first + sel // k
            if out_state is not None:  # a child's parent is the frontier node it came from
                idx = (sel // k).view(*sel.shape, *[1] * (out_state.dim() - 2))
                f_state = out_state.gather(1, idx.expand(*sel.shape, *out_state.shape[2:]))
            rows = nxt
        read = to_host(*(x for _, t, s, p in levels for x in (t, s, p)))  # one transfer
        host = [(r, *read[3 * i : 3 * i + 3]) for i, (r, *_) in enumerate(levels)]
        trees = []
        for b in range(B):
            nodes: dict[int, tuple[int, int, float, int]] = {}  # id → (token, parent id, score, depth)
            for level, (at, t, s, p) in enumerate(host, start=1):
                if b not in at:
                    break
                a = at[b]
                base = 0 if level == 1 else k + (level - 2) * k * k
                for j in range(len(t[a])):
                    nodes[base + j] = (t[a][j], p[a][j], s[a][j], level)
            trees.append(self._select(nodes))
            # Level 2 fed the level-1 frontier best first: the best first child (always node 0 of the
            # kept tree) sits at slot root + 1.
            self._written[seqs[b].seq_id] = [0] if depths[b] >= 2 else []
        return trees

    def _select(self, nodes: dict[int, tuple[int, int, float, int]]) -> DraftTree:
        """Keep the ``budget`` best nodes by cumulative log q, in topological order, siblings best first."""
        ranked = sorted(nodes, key=lambda i: (-nodes[i][2], nodes[i][3]))[: self.budget]
        kept = set(ranked)
        kept = {i for i in kept if all(a in kept for a in _ancestors(nodes, i))}
        order = sorted(kept, key=lambda i: (nodes[i][3], -nodes[i][2]))
        new_index = {old: new for new, old in enumerate(order)}
        return DraftTree(
            [nodes[i][0] for i in order],
            [new_index[nodes[i][1]] if nodes[i][1] >= 0 else -1 for i in order],
        )


def _ancestors(nodes: dict[int, tuple[int, int, float, int]], i: int) -> list[int]:
    out = []
    p = nodes[i][1]
    while p >= 0:
        out.append(p)
        p = nodes[p][1]
    return out
