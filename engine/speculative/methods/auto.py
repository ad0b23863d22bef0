"""Several proposers in one engine (``--speculative-method auto``, the default): each request is
drafted, step by step, by whichever of them pays for it.

The proposers held are the lookups, always (``suffix``: suffix trees over the request and earlier
outputs; ``ngram``: prompt lookup), and the model drafter a ``--draft-model`` directory names
(a draft model, Medusa / EAGLE / MTP heads). Each is a *route*. The controller
(``engine/speculative/controller.py``) chooses a route per sequence and step, from the request's own
measured acceptance by each route and each route's measured cost, and writes it to
``Sequence.spec_route``; this class only dispatches: every hook goes to the member that drafts the
sequence (or to every member, for what all of them must hear: computed tokens, forks, preemption,
the end of a request, block copies).

A model drafter's tree carries the n-gram lookup's continuation beside it when the lookup has one
(a *mixed tree*): its nodes hang under the root after the model's, or, where the model's nodes are
deterministic (greedy), under the model's nodes they repeat. The target verifies it in the same
forward; it stays exact because every node is verified by the rule its own draft calls for: a
lookup node is deterministic, and in a sampled tree its ``q`` row is one-hot at its token, for
which rejection sampling's test and residual are exactly the deterministic ones (``engine/sampling/
verify.py``). A sampled model node is never merged with a lookup node, even one with the same token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request.sequence import Sequence
from engine.sampling.tree import DraftTree
from engine.speculative.proposer import CostShape, ExtraRows, ProposeContext, Proposer, VerifyRows

LOOKUPS = ("suffix", "ngram")  # held whatever else is given: they cost no model forward
MIXED = "ngram"  # the lookup whose continuation rides beside a model drafter's tree


def mixed_tree(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, int]:
    """``tree`` with the lookup's ``chain`` beside it (see the module doc), and how many of the
    result's nodes are the tree's own (the first ones: the tree's nodes keep their indices)."""
    tokens, parents, parent, i = list(tree.tokens), list(tree.parents), -1, 0
    if tree.q is None:  # deterministic nodes: the chain follows the ones it repeats
        while i < len(chain):
            kid = next((j for j in range(len(tokens)) if parents[j] == parent and tokens[j] == chain[i]), None)
            if kid is None:
                break
            parent, i = kid, i + 1
    own = len(tree)
    if i == len(chain):
        return tree, own
    for token in chain[i:]:
        tokens.append(token)
        parents.append(parent)
        parent = len(tokens) - 1
    q = tree.q
    if q is not None:  # a lookup node in a sampled tree: one-hot q, the deterministic rule exactly
        rows = torch.zeros(len(chain) - i, q.shape[1], dtype=q.dtype, device=q.device)
        rows[torch.arange(len(rows)), torch.tensor(chain[i:], device=q.device)] = 1.0
        q = torch.cat([q, rows])
    return DraftTree(tokens, parents, q, tree.source), own


class AutoProposer(Proposer):
    method = "auto"

    def __init__(self, members: dict[str, Proposer]) -> None:
        self.members = members
        self.model = next((n for n, m in members.items() if m.cost.kind or m.hidden_layers), None)
        self.hidden_layers = tuple(sorted({layer for m in members.values() for layer in m.hidden_layers}))
        self.kv_bytes_per_token = sum(m.kv_bytes_per_token for m in members.values())
        self.has_language_model = any(m.has_language_model for m in members.values())
        self.reads_verify_logits = any(m.reads_verify_logits for m in members.values())
        self._own: dict[int, tuple[DraftTree, int]] = {}  # seq_id → (the model's own tree, its nodes) of a mixed tree

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids) -> AutoProposer:
        from engine.speculative.methods import method_for_draft, proposer_class

        names = list(LOOKUPS)
        if config.draft_model:
            names.append(method_for_draft(config.draft_model))
        members = {
            name: proposer_class(name).build(config, target, tokenizer=tokenizer, eos_token_ids=eos_token_ids)
            for name in names
        }
        return cls(members)

    def _member(self, route: str | None) -> Proposer:
        return self.members[route if route in self.members else self.routes()[0]]

    # -- routes -----------------------------------------------------------------------------------
    def routes(self) -> tuple[str, ...]:
        return tuple(self.members)

    def choices(self) -> tuple[str, ...]:
        # Prompt lookup drafts a subset of what suffix decoding does (the request's own context): as a
        # route of its own it would only split the requests' trials; it rides beside the model's trees.
        return tuple(name for name in self.members if name != MIXED)

    def cost_for(self, route: str | None) -> CostShape:
        return self._member(route).cost

    def slots_for(self, route: str | None, depth: int, greedy: bool = True) -> int:
        member = self._member(route)
        slots = member.slots_needed(depth, greedy)
        if member.method == self.model and MIXED in self.members:  # the lookup's chain beside
            slots += self.members[MIXED].slots_needed(depth, greedy)
        return slots

    def catch_up_tokens(self, seq: Sequence, route: str | None = None) -> int:
        return self._member(route).catch_up_tokens(seq)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return max(self.slots_for(route, depth, greedy) for route in self.members)

    def depth_for_slots(self, slots: int, depth: int, greedy: bool, route: str | None = None) -> int:
        member = self._member(route)
        depth = member.depth_for_slots(slots, depth, greedy)  # its own limits (a head count)
        while depth > 0 and self.slots_for(route, depth, greedy) > slots:
            depth -= 1
        return depth

    def deepest(self, configured: int) -> int:
        return max(m.deepest(configured) for m in self.members.values())

    def cost_kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for m in self.members.values() for k in m.cost_kinds()))

    def cost_probes(self) -> list[tuple[Callable, str]]:
        return [probe for m in self.members.values() for probe in m.cost_probes()]

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        trees: list[DraftTree] = [DraftTree() for _ in seqs]
        by_route: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_route.setdefault(self._member(seq.spec_route).method, []).append(i)
        for route, idx in by_route.items():
            sub = [seqs[i] for i in idx]
            drafted = self.members[route].propose(sub, [depths[i] for i in idx], ctx)
            chains = None
            if route == self.model and MIXED in self.members:
                chains = self.members[MIXED].propose(sub, [depths[i] for i in idx], ctx)
            for k, (i, tree) in enumerate(zip(idx, drafted)):
                tree.source = route
                if chains is not None and len(chains[k]):
                    merged, own = mixed_tree(tree, chains[k].tokens)
                    if merged is not tree:
                        self._own[seqs[i].seq_id] = (tree, own)
                        tree = merged
                trees[i] = tree
        return trees

    def extra_rows(self, seq: Sequence, tree: DraftTree, slots: int) -> ExtraRows | None:
        return self._member(seq.spec_route).extra_rows(seq, tree, slots)

    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        return next(m for m in self.members.values() if m.has_language_model).next_token_logits(seqs)

    def on_verify_logits(self, rows: list[VerifyRows], logits: torch.Tensor) -> None:
        for name, member in self.members.items():
            mine = [r for r in rows if (r.tree.source or self._member(r.seq.spec_route).method) == name]
            if mine and (member.reads_verify_logits or any(r.extra is not None for r in mine)):
                member.on_verify_logits(mine, logits)

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        own = self._own.pop(seq.seq_id, None)
        if own is not None:  # a mixed tree: the model hears of its own nodes on the path
            tree, n = own
            kept = 0
            while kept < len(accepted) and accepted[kept] < n:
                kept += 1
            accepted = accepted[:kept]
        self._member(tree.source).on_verified(seq, tree, accepted)

    def timings(self) -> list[tuple[str, int, int, float]]:
        return [t for m in self.members.values() for t in m.timings()]

    # -- what every member hears ------------------------------------------------------------------
    def warmup(self) -> None:
        for m in self.members.values():
            m.warmup()

    def runners(self) -> list:
        return [r for m in self.members.values() for r in m.runners()]

    def warm_compiled(self, view) -> None:
        for m in self.members.values():
            m.warm_compiled(view)

    def warm_chains(self, view) -> bool:
        return any([m.warm_chains(view) for m in self.members.values()])  # (a list: every member's)

    def allocate_kv(self, num_blocks: int) -> None:
        for m in self.members.values():
            m.allocate_kv(num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for m in self.members.values():
            m.copy_blocks(copies)

    def on_computed(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        for m in self.members.values():
            m.on_computed(seq, start, {layer: hidden[layer] for layer in m.hidden_layers if layer in hidden})

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        child.spec_route = parent.spec_route
        for m in self.members.values():
            m.on_fork(parent, child)

    def on_preempt(self, seq: Sequence) -> None:
        self._own.pop(seq.seq_id, None)
        for m in self.members.values():
            m.on_preempt(seq)

    def forget_adapter(self, name: str) -> None:
        for m in self.members.values():
            m.forget_adapter(name)

    def on_free(self, seq: Sequence) -> None:
        self._own.pop(seq.seq_id, None)
        for m in self.members.values():
            m.on_free(seq)
