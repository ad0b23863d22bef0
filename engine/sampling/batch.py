"""What one step carries between its stages (see ``step.py``): small dataclasses, no logic."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request.sequence import Sequence, TokenLogprob
from engine.runner.model_runner import ForwardChunk
from engine.sampling.tree import DraftTree


@dataclass
class Emit:
    """What one sequence produced this step: its new tokens (accepted nodes, then the final token)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    # How each token came (asked for by SamplingParams.include_speculation): (kind, proposer, depth), kind
    # one of PROVENANCE; the proposer that drafted it and the depth it was granted (None, 0: no draft)
    provenance: list[tuple[str, str | None, int]] | None = None


# accepted: a drafted token the target kept; bonus: the target's own token after a draft accepted to a
# leaf; recovered: the target's token where it rejected a draft; forced: the only token a grammar
# allowed (no forward); plain: a step without a draft
PROVENANCE = ("accepted", "bonus", "recovered", "forced", "plain")


@dataclass
class Sample:
    """A sequence whose next token is drawn this step, from the logits rows of its root and tree."""

    seq: Sequence
    tree: DraftTree  # empty: plain sampling
    row: int  # logits row of the root; node i is row + 1 + i
    tok: int  # flat token index of the root in the forward (for hidden states)
    depth: int = 0  # levels its draft really reached (the controller learns from those positions only)
    fork: bool = False  # its prompt just finished and its request has n > 1: the other choices fork here
    accepted: list[int] = field(default_factory=list)  # node indices the target kept, root to leaf
    # Structured outputs: [len(tree) + 1, words] int32 grammar bitmask of its rows (the tree already
    # cut to what the grammar allows), computed when the step cut the tree or on first use.
    masks: torch.Tensor | None = None
    proposed: DraftTree | None = None  # the tree as drafted, when a grammar cut it to ``tree``
    kept: list[int] | None = None  # then: the drafted tree's index of each node of ``tree``
    extra: int = 0  # rows of the proposer's own after the tree's (engine.speculative.proposer.ExtraRows)

    @property
    def drafted(self) -> DraftTree:
        """The tree its proposer drafted (before any grammar cut)."""
        return self.tree if self.proposed is None else self.proposed

    def grammar_masks(self, seq: Sequence) -> torch.Tensor:
        if self.masks is None:
            walk = seq.grammar.walk(self.tree.tokens, self.tree.parents)
            if len(walk.kept) != len(self.tree):
                raise RuntimeError("a draft tree reached verification with nodes its grammar forbids")
            self.masks = walk.masks
        return self.masks


@dataclass
class Batch:
    chunks: list[ForwardChunk] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    computed: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # (seq, start, n, first tok)
    prompt_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # (seq, row, start, n)
    searches: list = field(default_factory=list)  # engine.decoding.contrastive_search.Fed: candidates fed
    ended: list[Sequence] = field(default_factory=list)  # a sequence of each beam search that ended

    @property
    def decode_only(self) -> bool:
        """No prompt work in it: its tokens/s compare with other decode-only steps'."""
        return not self.prompt_spans and all(c.num_logits == len(c.token_ids) for c in self.chunks)
