"""Structured outputs in the step: a grammar-constrained sequence's draft is cut where its grammar
forbids a token, its emitted tokens advance its grammar, and the tokens its grammar then forces are
emitted with them (jump-forward). The masks themselves shape the rows in ``accept.RowsMetadata``.

Exactness: every row is masked before the acceptance rules read it, so a drafted token the grammar
forbids has target probability 0 and could never be accepted; cutting it (and what hangs under it)
only spares the forward its rows. A forced token is the only token its row allows: greedy decoding
takes it, and sampling draws it with probability 1, so emitting it without a forward changes
nothing but the time. Requests that asked for logprobs are not fast-forwarded (a forced token's
logprob needs its forward).
"""

from __future__ import annotations

from engine.request.sequence import Sequence
from engine.sampling.batch import Emit, Sample
from engine.sampling.tree import DraftTree


class Constraints:
    def __init__(self, jump_forward: bool = True) -> None:
        self.jump_forward = jump_forward
        # Totals since start (metrics): drafted tokens of constrained sequences, those the grammar cut,
        # and tokens emitted by jump-forward.
        self.drafted_tokens = 0
        self.cut_tokens = 0
        self.forced_tokens = 0

    def cut(self, seq: Sequence, tree: DraftTree) -> Sample:
        """A sample of ``seq`` holding its tree cut to what its grammar allows, with the masks of the
        cut tree's rows (its row and token indices are set when the step lays out the batch).

        A tree drawn from a draft distribution ``q`` and verified by rejection sampling is never cut:
        which of its tokens are forbidden depends on the draw, so leaving them out would change the
        proposal from ``q`` to ``q`` conditioned on the grammar, and the rule, still reading ``q``,
        would no longer be exact. Verification rejects them instead (the target gives them
        probability 0) and draws the next token from the residual, as for any rejected token.
        Deterministic drafts (greedy, seeded rows, lookups' one-hot ``q``) are cut."""
        sampled = tree.q is not None and not seq.params.greedy and seq.seed is None
        walk = seq.grammar.walk(tree.tokens, tree.parents, cut=not sampled)
        self.drafted_tokens += len(tree)
        self.cut_tokens += len(tree) - len(walk.kept)
        if len(walk.kept) == len(tree):
            return Sample(seq, tree, 0, 0, masks=walk.masks)
        index = {node: j for j, node in enumerate(walk.kept)}
        cut = DraftTree(
            [tree.tokens[i] for i in walk.kept],
            [index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in walk.kept],
            None if tree.q is None else tree.q[walk.kept],
        )
        return Sample(seq, cut, 0, 0, masks=walk.masks, proposed=tree, kept=walk.kept)

    def advance(self, e: Emit, max_model_len: int) -> None:
        """A constrained sequence's grammar follows what it emitted; tokens it then forces join the emit
        (up to the sequence's room)."""
        grammar = e.seq.grammar
        kept = grammar.advance(e.tokens)
        if kept < len(e.tokens):  # the grammar completed before the last: the output ends there
            del e.tokens[kept:]
            if e.logprobs is not None:
                del e.logprobs[kept:]
            if e.provenance is not None:
                del e.provenance[kept:]
        if self.jump_forward and e.seq.params.logprobs is None and e.logprobs is None:
            room = e.seq.tokens_left(max_model_len) - len(e.tokens)
            forced = grammar.forced(room)
            self.forced_tokens += len(forced)
            e.seq.group.num_forced_tokens += len(forced)
            e.tokens.extend(forced)
            if e.provenance is not None:
                e.provenance.extend([("forced", None, 0)] * len(forced))
