"""What the step (``engine/core/step.py``) asks of the strategies beyond sampling, one call per
stage, so that the step reads the same with or without them (see docs/decoding.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.decoding.beam import BeamSearch
from engine.decoding.contrastive import apply_contrast
from engine.decoding.contrastive_search import ContrastiveSearch, Fed
from engine.kv import BlockManager
from engine.request.confine import Confine
from engine.request.sequence import Sequence
from engine.sampling.accept import count_tokens
from engine.sampling.batch import Batch, Emit


class Strategies:
    def __init__(self, beams: BeamSearch, proposer, rows_md, confine: Confine) -> None:
        self.beams, self.search, self.proposer, self.rows = beams, ContrastiveSearch(), proposer, rows_md
        self.confine = confine

    def build(self, b: Batch, scheduled: list[tuple[Sequence, int]]) -> tuple[set[int], int]:
        """Contrastive search's candidates side by side, first in the batch (as many as the scheduler
        gave each: all its k, or a part). Returns their sequences and how many rows (one per token) they
        take."""
        searching = [(seq, n) for seq, n in scheduled if seq.num_candidates]
        self.search.candidates([seq for seq, _ in searching if seq.search.tokens is None], self.rows)
        rows = 0
        for seq, n in searching:
            chunk = self.search.chunk(seq, n)
            b.searches.append(Fed(seq, rows, rows, chunk.token_ids, seq.search.fed))
            b.chunks.append(chunk)
            rows += n
        return {seq.seq_id for seq, _ in searching}, rows

    def take(self, b: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, list[Sequence]]:
        """Before the sampling rules: rows that finish a contrastive search's prefill start its search,
        beam rows go to the beam search (a sequence of each search that ended is returned), and
        contrastive decoding's rows are reshaped (the logits the sampling rules then read)."""
        for s in [s for s in b.samples if s.seq.search is not None]:
            s.seq.search.start_token(logits[s.row])
            b.samples.remove(s)
        ended = []
        beams = [s for s in b.samples if s.seq.group.beam is not None]
        if beams:
            b.samples = [s for s in b.samples if s.seq.group.beam is None]
            ended = [g.seqs[0] for g in self.beams.accept(beams, logits, self.rows, self.confine)]
        contrast = [s for s in b.samples if s.seq.params.contrastive is not None]
        return (apply_contrast(logits, contrast, self.proposer) if contrast else logits), ended

    def choose(self, b: Batch, logits: torch.Tensor, final_hidden: torch.Tensor) -> list[Emit]:
        """Contrastive search's picks, as emits. ``b.searches`` keeps the searches that chose (one whose
        candidates are not all in yet waits for its next part, its slots held)."""
        b.searches = self.search.choose(b.searches, logits, final_hidden, self.confine)
        return [Emit(f.seq, [f.token]) for f in b.searches]

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
            count_tokens(seq, [f.token], vocab_size)
        return src, dst
