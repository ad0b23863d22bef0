"""Drafting with a separate small model that shares the target's tokenizer.

The draft keeps its own KV cache, indexed by the *same* block tables as the target's (one block id
names a block in both pools), so allocation, copy-on-write, preemption and tail release stay in sync
by construction. ``Sequence.draft_num_computed`` counts the leading tokens whose draft KV is valid.
Each step first *catches up* (feeds the draft what it has not seen, up to the root; long catch-ups,
e.g. a new prompt, are chunked under the step's token budget and draft nothing until done), then
drafts every level without waiting for the host: each level's tokens stay on the device and feed
the next forward, whose metadata the host prepared in advance. One transfer at the end builds the
trees.

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

Prefix reuse: the draft's blocks follow the target's hashes. A block whose draft KV the draft wrote
for a full block with hash ``h`` stays valid as long as the draft writes nothing else into it, so a
target prefix-cache hit on ``h`` is a draft hit too and its catch-up starts after it.
"""

from __future__ import annotations

import time

import torch

from engine.loader import load_config, load_model, load_tokenizer, resolve_model_path
from engine.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.sampler import SamplingMetadata, apply_logits_processors, compute_probs, exponential_noise
from engine.sequence import Sequence
from engine.speculative.early_stop import EarlyStop, draft_confidence, early_stop_for
from engine.speculative.proposer import CostShape, ProposeContext, Proposer, register
from engine.speculative.tree import DraftTree


@register
class DraftModelProposer(Proposer):
    method = "draft"
    cost = CostShape(kind="draft")

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        eos_token_ids: list[int],
        tree: bool,
        topk: int = 2,
        budget: int = 16,
        catch_up_budget: int = 2048,
        early_stop: EarlyStop | None = None,
    ) -> None:
        if topk < 1 or budget < 1:
            raise ValueError("spec tree topk and budget must be positive")
        self.runner = runner
        # The draft may pad its vocabulary differently from the target: its distributions are
        # widened to the target's (padding ids get no mass), and ids it has no row for are never fed.
        self.vocab_size = target_vocab_size
        self.draft_vocab_size = runner.vocab_size
        self.eos_token_ids = eos_token_ids
        self.tree = tree
        self.topk = topk
        self.budget = budget
        self.catch_up_budget = catch_up_budget
        self.early_stop = early_stop  # Draft & Verify's confidence exit (None: draft the planned depth)
        self.kv_bytes_per_token = runner.kv_bytes_per_token
        self.num_forwards = 0
        self._timings: list[tuple[str, int, int, float]] = []
        self._valid: dict[int, int] = {}  # block id → hash of the full block whose draft KV it holds
        # seq_id → node indices of this step's tree whose draft KV the draft wrote at their final slot
        # (root + 1 + i for the i-th of them): valid once verification keeps them.
        self._written: dict[int, list[int]] = {}
        self._marked: dict[int, int] = {}  # seq_id → leading full blocks already recorded in _valid

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids: list[int]) -> DraftModelProposer:
        if not config.draft_model:
            raise ValueError("speculative method 'draft' needs --draft-model")
        path = resolve_model_path(config.draft_model)
        draft_config = load_config(path)
        check_same_vocabulary(tokenizer, load_tokenizer(path), draft_config, target.hf_config, path)
        max_positions = target.model.rope_cos.shape[0]
        model = load_model(path, draft_config, target.dtype, target.device, max_positions, pack=not target.compiled)
        runner = ModelRunner(
            model, draft_config, target.device, target.dtype, config.block_size, compile=target.compiled
        )
        tree = config.spec_tree_topk > 1
        budget, catch_up = config.spec_tree_budget, config.max_num_batched_tokens
        stop = early_stop_for(config, default=None)
        return cls(runner, target.vocab_size, eos_token_ids, tree, config.spec_tree_topk, budget, catch_up, stop)

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

    # -- cache and lifecycle --------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)

    def warmup(self) -> None:
        self.runner.warmup()

    def cost_probe(self):
        return self.runner.forward

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for _, dst in copies:
            self._valid.pop(dst, None)
        self.runner.copy_blocks(copies)

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        # The root's draft KV is in place (catch-up wrote it). Nodes the draft fed at their final slot
        # (a chain's, a sampled tree's spine, a greedy tree's best first child) stay valid while the
        # accepted path follows them; anything else is recomputed by the next catch-up.
        self.observe_acceptance(seq, tree, accepted)
        written = self._written.pop(seq.seq_id, [])
        keep = 0
        while keep < min(len(accepted), len(written)) and accepted[keep] == written[keep]:
            keep += 1
        seq.draft_num_computed += keep

    def observe_acceptance(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        """Move the early-stop threshold by how much of the drafted depth the target accepted."""
        if self.early_stop is not None and len(tree):
            self.early_stop.observe(seq.params.greedy, tree.depth, len(accepted))

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        child.draft_num_computed = parent.draft_num_computed

    def on_preempt(self, seq: Sequence) -> None:
        seq.draft_num_computed = 0
        self._written.pop(seq.seq_id, None)
        self._marked.pop(seq.seq_id, None)

    def on_free(self, seq: Sequence) -> None:
        self._written.pop(seq.seq_id, None)
        self._marked.pop(seq.seq_id, None)

    def timings(self) -> list[tuple[str, int, int, float]]:
        out, self._timings = self._timings, []
        return out

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        ready, logits = self._root_logits(seqs)
        out = [DraftTree() for _ in seqs]
        groups = {True: [], False: []}
        for j, i in enumerate(ready):
            groups[self.tree and seqs[i].params.greedy].append((i, j))
        for as_tree, members in groups.items():
            if members:
                sub = logits[[j for _, j in members]]
                draft = self._greedy_trees if as_tree else self._sampled
                trees = draft([seqs[i] for i, _ in members], [depths[i] for i, _ in members], sub)
                for (i, _), tree in zip(members, trees):
                    out[i] = tree
        return out

    def _root_logits(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """Catch up (feed the draft what it has not seen, chunked under the budget): the indices of
        the sequences whose root was reached, and the draft's logits there ``[len(ready), V]``."""
        ready, chunks, budget = [], [], self.catch_up_budget
        for i, s in enumerate(seqs):
            self._skip_cached_prefix(s)
            n = s.num_tokens - s.draft_num_computed
            take = min(n, max(budget, 1))
            budget -= take
            start = s.draft_num_computed
            chunks.append(ForwardChunk(s.token_ids[start : start + take], start, s.block_table, int(take == n)))
            if take == n:
                ready.append(i)
        logits = self._forward(self.runner.prepare(chunks), chunks)  # [len(ready), V] at each ready root
        for s, c in zip(seqs, chunks):
            s.draft_num_computed += len(c.token_ids)
            self._mark_valid(s)
        return ready, logits

    def _forward(self, batch: ForwardBatch, chunks: list[ForwardChunk], input_ids=None) -> torch.Tensor:
        """One draft forward (logits widened to the target's vocabulary), timed for the cost model."""
        self.num_forwards += 1
        t0 = time.perf_counter()
        bs = self.runner.block_size
        for c in chunks:  # the draft overwrites these slots: their blocks no longer hold a cached prefix
            for b in range(c.ctx_len // bs, (c.ctx_len + len(c.token_ids) - 1) // bs + 1):
                self._valid.pop(c.block_table[b], None)
        if input_ids is None and self.draft_vocab_size < self.vocab_size:
            batch.input_ids = batch.input_ids.clamp(max=self.draft_vocab_size - 1)
        logits = self.runner.execute(batch, input_ids=input_ids).logits
        if logits.shape[1] != self.vocab_size:
            wide = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            n = min(self.vocab_size, logits.shape[1])
            wide[:, :n] = logits[:, :n]
            logits = wide
        self.runner.synchronize()
        self._timings.append(("draft", batch.num_seqs, batch.num_tokens, time.perf_counter() - t0))
        return logits

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

    def _level(
        self,
        seqs: list[Sequence],
        ids: torch.Tensor,  # [A, per_seq] tokens still on the device
        per_seq: int,
        first: list[int],
        depth: int,
        masks: list[torch.Tensor] | None = None,  # per sequence [per_seq, first + per_seq] ancestor mask
    ) -> torch.Tensor:
        """Feed ``per_seq`` device-resident tokens per sequence at slots ``root + 1 + first[b] ...``,
        all at position ``root + depth``; returns their logits."""
        chunks = []
        for b, s in enumerate(seqs):
            root = s.num_tokens - 1
            mask, mask_start = (masks[b], root + 1) if masks is not None else (None, None)
            positions = [root + depth] * per_seq
            slot = root + 1 + first[b]
            chunks.append(ForwardChunk([0] * per_seq, slot, s.block_table, per_seq, positions, mask, mask_start))
        if self.draft_vocab_size < self.vocab_size:
            ids = ids.clamp(max=self.draft_vocab_size - 1)
        return self._forward(self.runner.prepare(chunks), chunks, input_ids=ids.reshape(-1))

    def _sampled(self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor) -> list[DraftTree]:
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
            self.runner.device,
        )
        level_rows: list[dict[int, int]] = []  # per level: sequence index → its row at that level
        level_tokens: list[torch.Tensor] = []  # [A, k] per level
        level_q: list[torch.Tensor] = []  # [A, k, V] per level (the distribution each sibling was drawn from)
        rows, cur = list(range(B)), logits
        fed = [0] * B  # spine tokens fed back per sequence (their draft KV sits at their final slots)
        for d in range(D):
            mdl = md.select(rows)
            cur = apply_logits_processors(cur, mdl) if mdl.needs_processing else cur
            q = compute_probs(cur, mdl)  # [A, V]
            if self.early_stop is not None and d > 0:  # rows whose drafter is unsure stop before this level
                sure = self._sure(cur, q, [seqs[b].params.greedy for b in rows])
                if len(sure) < len(rows):
                    if not sure:
                        break
                    idx = torch.tensor(sure, device=cur.device)
                    rows, cur, q = [rows[a] for a in sure], cur[idx], q[idx]
                    mdl = md.select(rows)
            # A seeded request drafts with the noise its verification samples the same position with
            # (coupled draws: the draft is kept whenever its choice is also the target's).
            noise = [seqs[b].noise_key(d) if not seqs[b].params.greedy else None for b in rows]
            if k == 1:
                order = (q if mdl.all_greedy else q / exponential_noise(q, noise)).argmax(-1, keepdim=True)
                qs = q[:, None]
            else:  # k distinct siblings, and the distribution each was drawn from
                order = (q / exponential_noise(q, noise)).topk(k, dim=-1).indices  # [A, k]
                taken = torch.zeros_like(q, dtype=torch.bool)
                qs = []
                for i in range(k):
                    qi = q.masked_fill(taken, 0.0)
                    qs.append(qi / qi.sum(-1, keepdim=True).clamp_min(1e-30))
                    taken.scatter_(1, order[:, i : i + 1], True)
                qs = torch.stack(qs, 1)
            at = {b: a for a, b in enumerate(rows)}
            level_rows.append(at)
            level_tokens.append(order)
            level_q.append(qs)
            nxt = [b for b in rows if depths[b] > d + 1]
            if not nxt:
                break
            keep = torch.tensor([at[b] for b in nxt], device=cur.device)
            spine = order[keep, 0]
            cur = self._level([seqs[b] for b in nxt], spine, 1, [d] * len(nxt), d + 1)
            for b in nxt:
                fed[b] += 1
            rows = nxt
        # One transfer: tokens and the probability each sibling had, for every level.
        tok_host = [t.tolist() for t in level_tokens]
        p_host = [qs.gather(2, t[:, :, None])[:, :, 0].tolist() for qs, t in zip(level_q, level_tokens)]
        trees = []
        for b in range(B):
            toks, parents, qrows, spine_node, spine = [], [], [], -1, []
            for d, at in enumerate(level_rows):
                if b not in at:
                    break
                a = at[b]
                first = len(toks)
                for i in range(k):
                    if i > 0 and p_host[d][a][i] <= 0.0:
                        continue  # fewer than k tokens have mass (top-k / top-p): no such sibling
                    toks.append(tok_host[d][a][i])
                    parents.append(spine_node)
                    qrows.append(level_q[d][a, i])
                spine_node = first
                spine.append(first)
            q = torch.stack(qrows) if qrows and not seqs[b].params.greedy else None  # [n, V]
            trees.append(DraftTree(toks, parents, q))
            self._written[seqs[b].seq_id] = spine[: fed[b]]
        return trees

    def _greedy_trees(self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor) -> list[DraftTree]:
        k, B, D = self.topk, len(seqs), max(depths)
        dev = logits.device
        score, tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k] level 1
        rows = list(range(B))
        # per level: (sequence index → its row, tokens, scores, parent ids)
        levels = [({b: b for b in rows}, tok, score, torch.full_like(tok, -1))]
        f_ids = torch.arange(k, device=dev).expand(B, k)  # frontier node ids
        f_tok, f_score, f_run = tok, score, None  # frontier tokens, scores, parents' run rows
        run_max = max(D - 1, 1) * k
        anc = torch.zeros(B, run_max, run_max, dtype=torch.bool, device=dev)  # run row → its ancestors' run rows
        for level in range(2, D + 1):
            nxt = [b for b in rows if depths[b] >= level]
            if not nxt:
                break
            at = {b: a for a, b in enumerate(rows)}
            keep = torch.tensor([at[b] for b in nxt], device=dev)
            f_ids, f_tok, f_score = f_ids[keep], f_tok[keep], f_score[keep]
            first = (level - 2) * k  # run rows of the frontier fed now
            new = torch.arange(first, first + k, device=dev)
            sub = anc[nxt]  # [A, R, R]
            if f_run is not None:
                sub[:, first : first + k] = sub.gather(1, f_run[keep][:, :, None].expand(-1, -1, run_max))
            sub[:, new, new] = True
            anc[nxt] = sub
            masks = [sub[a, first : first + k, : first + k] for a in range(len(nxt))]
            logits = self._level([seqs[b] for b in nxt], f_tok, k, [first] * len(nxt), level - 1, masks)
            child = torch.log_softmax(logits.float(), -1)
            cv, ci = child.view(len(nxt), k, -1).topk(k, dim=-1)  # [A, k, k]
            if self.early_stop is not None:  # a row stops when no frontier node has a confident child
                sure = self._sure_levels(cv[:, :, 0], nxt)
                if len(sure) < len(nxt):
                    if not sure:
                        break
                    at = {b: a for a, b in enumerate(nxt)}
                    keep = torch.tensor([at[b] for b in sure], device=dev)
                    cv, ci, f_ids, f_score = cv[keep], ci[keep], f_ids[keep], f_score[keep]
                    nxt = sure
            c_score = (f_score[:, :, None] + cv).flatten(1)  # [A, k*k] cumulative log q
            c_tok = ci.flatten(1)
            c_par = f_ids.repeat_interleave(k, dim=1)
            levels.append(({b: a for a, b in enumerate(nxt)}, c_tok, c_score, c_par))
            f_score, sel = c_score.topk(k, dim=-1)
            base = k + (level - 2) * k * k
            f_ids, f_tok, f_run = base + sel, c_tok.gather(1, sel), first + sel // k
            rows = nxt
        host = [(r, t.tolist(), s.tolist(), p.tolist()) for r, t, s, p in levels]  # one transfer
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

    # -- prefix reuse ---------------------------------------------------------------------------
    def _skip_cached_prefix(self, seq: Sequence) -> None:
        """Start catch-up after the leading full blocks whose draft KV is valid for their hash."""
        bs = self.runner.block_size
        n = seq.draft_num_computed // bs  # the blocks before are computed already
        while n < len(seq.block_hashes) and self._valid.get(seq.block_table[n]) == seq.block_hashes[n]:
            n += 1
        n = min(n * bs, seq.num_tokens - 1)  # the root is always fed
        if n > seq.draft_num_computed:
            seq.draft_num_computed = n

    def _mark_valid(self, seq: Sequence) -> None:
        """Record the full blocks whose draft KV is now computed, from where the last call stopped:
        blocks before are final and never written again while the sequence holds them."""
        end = min(len(seq.block_hashes), seq.draft_num_computed // self.runner.block_size)
        for i in range(self._marked.get(seq.seq_id, 0), end):
            self._valid[seq.block_table[i]] = seq.block_hashes[i]
        self._marked[seq.seq_id] = max(end, self._marked.get(seq.seq_id, 0))


def _ancestors(nodes: dict[int, tuple[int, int, float, int]], i: int) -> list[int]:
    out = []
    p = nodes[i][1]
    while p >= 0:
        out.append(p)
        p = nodes[p][1]
    return out


def check_same_vocabulary(target_tok, draft_tok, draft_config, target_config, draft_path) -> None:
    """A draft must speak the target's vocabulary: same ids for the same tokens."""
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"the draft model {draft_path} has a different tokenizer vocabulary from the target; "
            "speculative decoding needs the same tokenizer"
        )
    # Checkpoints of one family often pad their embedding tables differently (Qwen2.5-7B: 152064,
    # Qwen2.5-0.5B: 151936); that is fine as long as both cover the shared tokenizer.
    need = len(target_tok)
    for name, cfg in (("draft", draft_config), ("target", target_config)):
        if cfg.vocab_size < need:
            raise ValueError(f"the {name} model's vocab_size ({cfg.vocab_size}) is smaller than its tokenizer ({need})")
