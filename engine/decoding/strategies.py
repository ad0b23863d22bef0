"""What the step (``engine/core/step.py``) asks of the strategies beyond sampling, one call per
stage, so that the step reads the same with or without them (see docs/decoding.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.decoding.beam import BeamSearch
from engine.decoding.contrastive import apply_contrast
from engine.decoding.contrastive_search import ContrastiveSearch, Fed
from engine.kv import BlockManager
from engine.request.sequence import Sequence
from engine.sampling.accept import count_tokens
from engine.sampling.batch import Batch, Emit


class Strategies:
    def __init__(self, beams: BeamSearch, proposer, rows_md) -> None:
        self.beams, self.search, self.proposer, self.rows = beams, ContrastiveSearch(), proposer, rows_md

    def build(self, b: Batch, scheduled: list[tuple[Sequence, int]]) -> tuple[set[int], int]:
        """Contrastive search's candidates side by side, first in the batch. Returns their sequences
        and how many rows (one per token) they take."""
        candidates = self.search.candidates([seq for seq, _ in scheduled if seq.num_candidates], self.rows)
        n = 0
        for seq, _ in scheduled:
            if seq.seq_id in candidates:
                b.searches.append(Fed(seq, n, n, candidates[seq.seq_id]))
                b.chunks.append(self.search.chunk(seq, candidates[seq.seq_id]))
                n += len(candidates[seq.seq_id])
        return set(candidates), n

    def take(self, b: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, list[Sequence]]:
        """Before the sampling rules: rows that finish a contrastive search's prefill start its search,
        beam rows go to the beam search (a sequence of each search that ended is returned), and
        contrastive decoding's rows are reshaped (the logits the sampling rules then read)."""
        for s in [s for s in b.samples if s.seq.search is not None]:
            s.seq.search.next_logits = logits[s.row]
            b.samples.remove(s)
        ended = []
        beams = [s for s in b.samples if s.seq.group.beam is not None]
        if beams:
            b.samples = [s for s in b.samples if s.seq.group.beam is None]
            ended = [g.seqs[0] for g in self.beams.accept(beams, logits, self.rows)]
        contrast = [s for s in b.samples if s.seq.params.contrastive is not None]
        return (apply_contrast(logits, contrast, self.proposer) if contrast else logits), ended

    def choose(self, b: Batch, logits: torch.Tensor, final_hidden: torch.Tensor) -> list[Emit]:
        """Contrastive search's picks, as emits."""
        self.search.choose(b.searches, logits, final_hidden)
        return [Emit(f.seq, [f.tokens[f.chosen]]) for f in b.searches]

    def place(self, b: Batch, bm: BlockManager, slot: Callable[[Sequence, int], int], vocab_size: int):
        """Each chosen candidate's K/V belongs in its sequence's next slot; the others' are released.
        Returns the (src, dst) slot moves."""
        src, dst = [], []
        for f in b.searches:
            seq, c = f.seq, f.seq.num_computed_tokens
            if f.chosen:
                src.append(slot(seq, c + f.chosen))
                dst.append(slot(seq, c))
            seq.num_computed_tokens = c + 1
            bm.release_tail(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
            count_tokens(seq, [f.tokens[f.chosen]], vocab_size)
        return src, dst
