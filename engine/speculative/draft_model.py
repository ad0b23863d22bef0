"""Drafting with a separate small model that shares the target's tokenizer.

The draft keeps its own KV pool, indexed by the *same* block tables as the target's (one block id
names a block in both pools), so allocation, copy-on-write, preemption and tail release stay in sync
by construction. ``Sequence.draft_num_computed`` counts the leading tokens whose draft KV is valid;
each step first feeds the draft what it has not seen (up to the root), then drafts:

- chains: ``K`` tokens, one draft forward per token; greedy requests take the argmax, sampled ones
  sample from the draft distribution ``q`` shaped by the request's own parameters (kept for
  rejection sampling);
- trees (EAGLE-2-style dynamic expansion): each level expands the ``topk`` nodes with the highest
  cumulative draft log-probability into their ``topk`` best children; finally all nodes are reranked
  by cumulative log-probability and the best ``budget`` kept (an ancestor always outranks its
  descendants, so the kept set is a tree). Tree nodes are deterministic: verification treats their
  ``q`` as one-hot.

In tree mode, greedy requests get trees and sampling requests get sampled chains: a deterministic
child is accepted with probability ``p(x)`` — little when ``p`` is spread out — while a child sampled
from ``q`` is accepted with ``min(1, p/q)``, i.e. ``1 − TV(p, q)`` on average.
"""

from __future__ import annotations

import time

import torch

from engine.model_runner import ForwardChunk, ModelRunner
from engine.sampler import SamplingMetadata, apply_logits_processors, compute_probs, sample_from_probs
from engine.sequence import Sequence
from engine.speculative.proposer import ProposeContext
from engine.speculative.tree import DraftTree


class DraftModelProposer:
    method = "draft"

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        eos_token_ids: list[int],
        tree: bool,
        topk: int = 2,
        budget: int = 16,
    ):
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
        self.num_forwards = 0
        self._timings: list[tuple[str, int, float]] = []
        self._chain_drafted: set[int] = set()  # sequences drafted as chains this step (draft KV in place)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        if depth <= 0:
            return 0
        if not self.tree or not greedy:
            return depth
        nodes = min(self.budget, self.topk + (depth - 1) * self.topk * self.topk)
        return max(nodes, (depth - 1) * self.topk)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def on_verified(self, seq: Sequence, tree: DraftTree, num_accepted: int) -> None:
        # The root's draft KV is in place (catch-up wrote it). A chain's fed nodes sit in their final
        # slots too, so the accepted ones stay valid; a tree's nodes were written in expansion order,
        # so they are recomputed by the next catch-up.
        root_end = seq.draft_num_computed
        if seq.seq_id in self._chain_drafted:
            root_end += min(num_accepted, max(len(tree) - 1, 0))
        seq.draft_num_computed = root_end

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        chunks = [
            ForwardChunk(s.token_ids[s.draft_num_computed :], s.draft_num_computed, s.block_table, 1) for s in seqs
        ]
        logits = self._forward(chunks)  # [B, V] at each root
        for s in seqs:
            s.draft_num_computed = s.num_tokens
        as_tree = [self.tree and s.params.greedy for s in seqs]
        self._chain_drafted = {s.seq_id for s, t in zip(seqs, as_tree) if not t}
        out: list[DraftTree | None] = [None] * len(seqs)
        for shape, draft in ((True, self._trees), (False, self._chains)):
            idx = [i for i, t in enumerate(as_tree) if t == shape]
            if idx:
                sub = logits[idx] if len(idx) < len(seqs) else logits
                for i, tree in zip(idx, draft([seqs[i] for i in idx], [depths[i] for i in idx], sub)):
                    out[i] = tree
        return out

    def _forward(self, chunks: list[ForwardChunk]) -> torch.Tensor:
        self.num_forwards += 1
        t0 = time.perf_counter()
        for c in chunks:
            if any(t >= self.draft_vocab_size for t in c.token_ids):
                c.token_ids = [t if t < self.draft_vocab_size else 0 for t in c.token_ids]
        logits = self.runner.forward(chunks).logits
        if logits.shape[1] != self.vocab_size:
            wide = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            n = min(self.vocab_size, logits.shape[1])
            wide[:, :n] = logits[:, :n]
            logits = wide
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self._timings.append(("draft", sum(len(c.token_ids) for c in chunks), time.perf_counter() - t0))
        return logits

    def runner_timings(self) -> list[tuple[str, int, float]]:
        """(kind, tokens, seconds) of the draft forwards since the last call, for the cost model."""
        out, self._timings = self._timings, []
        return out

    def _chains(self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor) -> list[DraftTree]:
        B = len(seqs)
        drafted: list[list[int]] = [[] for _ in range(B)]
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
        active = [b for b in range(B) if depths[b] > 0]
        cur = logits[active] if len(active) < B else logits
        d = 0
        while active:
            md = SamplingMetadata.build(
                [seqs[b].params for b in active],
                [seqs[b].prompt_ids for b in active],
                [seqs[b].output_ids + drafted[b] for b in active],
                [seqs[b].generator for b in active],
                self.eos_token_ids,
                self.vocab_size,
                self.runner.device,
            )
            q = compute_probs(apply_logits_processors(cur, md) if md.needs_processing else cur, md)
            chosen = sample_from_probs(q, md).tolist()
            for i, b in enumerate(active):
                drafted[b].append(chosen[i])
                if not seqs[b].params.greedy:
                    q_rows[b].append(q[i])
            d += 1
            nxt = [b for b in active if depths[b] > d]
            if not nxt:
                break
            chunks = [ForwardChunk([drafted[b][-1]], seqs[b].num_tokens + d - 1, seqs[b].block_table, 1) for b in nxt]
            cur = self._forward(chunks)
            active = nxt
        return [DraftTree.chain(drafted[b], torch.stack(q_rows[b]) if q_rows[b] else None) for b in range(B)]

    def _trees(self, seqs: list[Sequence], depths: list[int], logits: torch.Tensor) -> list[DraftTree]:
        k = self.topk
        B = len(seqs)
        # Per sequence: generated nodes (token, parent node index, cumulative log q, depth) and, for
        # nodes fed to the draft, their run index (their KV slot is root slot + 1 + run index).
        nodes: list[list[tuple[int, int, float, int]]] = [[] for _ in range(B)]
        run_of_node: list[dict[int, int]] = [{} for _ in range(B)]
        run_chain: list[list[list[int]]] = [[] for _ in range(B)]  # run index → run indices of its path
        frontier: list[list[int]] = [[] for _ in range(B)]

        logq = torch.log_softmax(logits.float(), -1)
        top_v, top_i = logq.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for b in range(B):
            if depths[b] <= 0:
                continue
            for j in range(k):
                nodes[b].append((top_i[b][j], -1, top_v[b][j], 1))
            frontier[b] = list(range(k))

        level = 1
        while True:
            expand = [b for b in range(B) if depths[b] > level and frontier[b]]
            if not expand:
                break
            chunks = []
            for b in expand:
                seq = seqs[b]
                root = seq.num_tokens - 1
                first_run = len(run_chain[b])
                for node in frontier[b]:
                    parent = nodes[b][node][1]
                    path = (run_chain[b][run_of_node[b][parent]] if parent >= 0 else []) + [len(run_chain[b])]
                    run_of_node[b][node] = len(run_chain[b])
                    run_chain[b].append(path)
                n_run = len(run_chain[b])
                mask = torch.zeros(k, n_run, dtype=torch.bool)
                for i in range(k):
                    mask[i, run_chain[b][first_run + i]] = True
                chunks.append(
                    ForwardChunk(
                        [nodes[b][node][0] for node in frontier[b]],
                        root + 1 + first_run,
                        seq.block_table,
                        k,
                        positions=[root + level] * k,
                        tree_mask=mask,
                        mask_start=root + 1,
                    )
                )
            child_logq = torch.log_softmax(self._forward(chunks).float(), -1)  # [len(expand) * k, V]
            cv, ci = child_logq.topk(k, dim=-1)
            cv, ci = cv.view(len(expand), k, k), ci.view(len(expand), k, k)
            level += 1
            for e, b in enumerate(expand):
                parents = frontier[b]
                base = torch.tensor([nodes[b][p][2] for p in parents], device=cv.device)[:, None]
                scores = (base + cv[e]).flatten()  # [k * k] cumulative log q of every child
                tokens = ci[e].flatten().tolist()
                order = scores.argsort(descending=True).tolist()
                score_list = scores.tolist()
                first_new = len(nodes[b])
                for j in range(k * k):
                    nodes[b].append((tokens[j], parents[j // k], score_list[j], level))
                frontier[b] = [first_new + j for j in order[:k]]
        return [self._select(nodes[b]) if depths[b] > 0 else DraftTree() for b in range(B)]

    def _select(self, nodes: list[tuple[int, int, float, int]]) -> DraftTree:
        """Keep the ``budget`` best nodes by cumulative log q, in topological order, siblings best first."""
        ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], nodes[i][3]))[: self.budget]
        kept = set(ranked)
        kept = {i for i in kept if all(a in kept for a in _ancestors(nodes, i))}
        order = sorted(kept, key=lambda i: (nodes[i][3], -nodes[i][2]))
        new_index = {old: new for new, old in enumerate(order)}
        return DraftTree(
            [nodes[i][0] for i in order],
            [new_index[nodes[i][1]] if nodes[i][1] >= 0 else -1 for i in order],
        )


def _ancestors(nodes: list[tuple[int, int, float, int]], i: int) -> list[int]:
    out = []
    p = nodes[i][1]
    while p >= 0:
        out.append(p)
        p = nodes[p][1]
    return out
