"""Run-ahead decoding (asynchronous scheduling): the next forward is launched before the last one's
tokens are read.

A plain decode step waits for the device once, for its tokens, and between that wait and the next
forward's launch the device idles while the host appends tokens, checks stops, publishes outputs
and builds the next batch. Once every running sequence is a plain greedy decode, the engine keeps
one forward *pending* instead: step k launches forward k + 1 with forward k's argmax as its input
ids, still on the device, and only then reads forward k's tokens (engine/runner/readback.py: a wait
for forward k alone). Everything the host does for step k's tokens then runs while the device
computes forward k + 1.

Exact. The tokens are the same argmax of the same logits plain decoding takes; a forward's inputs are
the token before and the positions and KV slots it would have had. A sequence that forward k's
token ends (end of sequence, a stop token or string) already has a row in forward k + 1: that row
is dropped, and the KV slot it wrote lies in blocks freed with the sequence, which only a later
forward can reuse (the device runs forwards in launch order).

State between two steps while a forward is pending over sequences ``S``: each has ``L`` known
tokens, all ``L`` computed (the pending forward computed position ``L - 1``) and its token ``L`` on
the device. The scheduler never sees that state: whenever the next step is not the same batch
again, the step *drains* instead (reads the pending tokens and hands them out, the sequences back to
ordinary decodes) and the next step is an ordinary one (engine/core/step.py).

The batch is "the same again" when ``S`` is every running sequence, nothing waits for admission,
each sequence is a plain greedy decode (no grammar, logprobs, penalties, bias, ``min_tokens`` still
to serve, beams or contrastive search), each may still generate two tokens (by ``max_tokens`` and
the context; the pending one and the next) and the KV pool gives each the next slot. Engines with a
proposer, sampled requests and tensor parallelism run ordinary steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler import Scheduler
from engine.request.sequence import Sequence, SequenceStatus
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.runner.readback import Readback, Ticket


@dataclass
class Pending:
    """A forward launched and not read: one row per sequence, in this order."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [len(seqs)] int64 argmax, on the device
    ticket: Ticket


def plain_greedy(seq: Sequence) -> bool:
    """Its next token is the raw logits' argmax and nothing else of it is read."""
    p = seq.params
    return (
        p.greedy
        and seq.grammar is None
        and seq.search is None
        and seq.group.beam is None
        and p.logprobs is None
        and not p.needs_penalties
        and not p.logit_bias
        and not p.no_repeat_ngram_size
        and seq.num_output_tokens >= p.min_tokens
    )


class RunAhead:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, max_model_len: int, max_num_seqs: int) -> None:
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.readback = Readback(runner.device, max_num_seqs)
        self.pending: Pending | None = None
        self.num_launched = 0  # forwards launched ahead of a read (the tests' witness that it ran)

    def startable(self) -> list[Sequence] | None:
        """After an ordinary step: the running sequences, if all are plain greedy decodes with a token
        to go and nothing waits (the first forward ahead starts from their known last tokens)."""
        running = self.scheduler.running
        if not running or self.scheduler.waiting or len(running) > self.scheduler.max_num_batched_tokens:
            return None
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0 or not plain_greedy(seq):
                return None
            if seq.tokens_left(self.max_model_len) < 1:
                return None
        return list(running)

    def steady(self, pending: Pending) -> bool:
        """May the forward after ``pending`` run ahead over the same sequences?"""
        seqs = pending.seqs
        if self.scheduler.waiting or len(self.scheduler.running) != len(seqs):
            return False
        # The pending token is the output's next one: two to go means one more after it.
        return all(
            s.status is SequenceStatus.RUNNING and plain_greedy(s) and s.tokens_left(self.max_model_len) >= 2
            for s in seqs
        )

    def launch(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> Pending | None:
        """Launch one decode forward over ``seqs`` at their next uncomputed position, its input ids
        ``input_ids`` (the pending forward's tokens, on the device) or else each one's last token.
        None, with nothing launched, where the KV pool cannot give every sequence its slot."""
        bm, copies = self.scheduler.bm, []
        for seq in seqs:
            got = bm.reserve(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + 1)
            if got is None:  # slots reserved for the others stay theirs: the next ordinary step uses them
                return None
            copies.extend(got)
        self.runner.copy_blocks(copies)
        chunks = [
            ForwardChunk([0 if input_ids is not None else s.token_ids[-1]], s.num_computed_tokens, s.block_table, 1)
            for s in seqs
        ]
        out = self.runner.execute(self.runner.prepare(chunks), input_ids=input_ids)
        tokens = out.logits.argmax(-1)
        self.num_launched += 1
        return Pending(seqs, tokens, self.readback.start(tokens))
