"""Run-ahead decoding (asynchronous scheduling): the next forward is launched before the last one's
tokens are read.

A plain decode step waits for the device once, for its tokens, and between that wait and the next
forward's launch the device idles while the host appends tokens, checks stops, publishes outputs
and builds the next batch. Once every running sequence is a plain decode, the engine keeps one
forward *pending* instead: step k launches forward k + 1 with forward k's tokens as its input ids,
still on the device, and only then reads forward k's tokens (engine/runner/readback.py: a wait
for forward k alone). Everything the host does for step k's tokens then runs while the device
computes forward k + 1.

Exact. A forward's inputs are the token before and the positions and KV slots an ordinary step would
give it, and its tokens are drawn as an ordinary step draws them (``sampled_tokens``,
engine/sampling/accept.py): the argmax; for a seeded request the noise of (seed, output position),
the same tokens; for an unseeded one a fresh uniform a row, the same distribution. A sequence that
forward k's token ends (end of sequence, a stop token or string) already has a row in forward k + 1:
that row is dropped, and the KV slot it wrote lies in blocks freed with the sequence, which only a
later forward can reuse (the device runs forwards in launch order).

State between two steps while a forward is pending over sequences ``S``: each has ``L`` known
tokens, all ``L`` computed (the pending forward computed position ``L - 1``) and its token ``L`` on
the device. The scheduler never sees that state: whenever the next step is not the same batch
again, the step *drains* instead (reads the pending tokens and hands them out, the sequences back to
ordinary decodes) and the next step is an ordinary one (engine/core/step.py).

The batch is "the same again" when ``S`` is every running sequence, nothing waits for a free seat,
each sequence is a plain decode (no grammar, logprobs, penalties, bias, no-repeat n-grams,
``min_tokens`` still to serve, beams, contrastive search or decoding) and all are of one kind (greedy, seeded
or unseeded sampling), each may still generate two tokens (by ``max_tokens`` and the context; the
pending one and the next) and the KV pool gives each the next slot.

Speculative engines run ahead while the controller drafts nothing (the guard has turned drafting
off; no request's trial or idle probe is due). Before each launch the engine asks the controller
for the plan of the step that forward is (the step after the pending tokens); a plan that drafts
drains and its step runs as an ordinary one on that plan (so does one whose launch finds no KV
slots), so no step is planned twice (trials, probes and the guard's bursts are counted once). Steps
ahead feed the guard's plain rate: drafting is held to plain decoding as it runs here. Proposers
that read the target's features of every computed token (EAGLE, Medusa, MTP) and tensor parallelism
run ordinary steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler import Scheduler
from engine.request.sequence import Sequence, SequenceStatus
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.runner.readback import Readback, Ticket
from engine.sampling.accept import sampled_tokens
from engine.sampling.sampler import SamplingMetadata


@dataclass
class Pending:
    """A forward launched and not read: one row per sequence, in this order."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [len(seqs)] int64, on the device
    ticket: Ticket


def kind(seq: Sequence) -> str | None:
    """How its next token is drawn (greedy, seeded, random) where a forward ahead may draw it: nothing
    but the temperature, top-k, top-p and min-p shape its row and only the token is read. Else None."""
    p = seq.params
    plain = (
        seq.grammar is None
        and seq.search is None
        and p.contrastive is None  # contrastive decoding: the amateur's logits shape its rows
        and seq.group.beam is None
        and p.logprobs is None
        and not p.needs_penalties
        and not p.logit_bias
        and not p.no_repeat_ngram_size
        and seq.num_output_tokens >= p.min_tokens
    )
    if not plain:
        return None
    return "greedy" if p.greedy else "seeded" if seq.seed is not None else "random"


def one_kind(seqs: list[Sequence]) -> str | None:
    """The kind all of ``seqs`` share, if they share one."""
    kinds = {kind(s) for s in seqs}
    return kinds.pop() if len(kinds) == 1 else None


class RunAhead:
    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, max_model_len: int, max_num_seqs: int, eos_token_ids: list[int]
    ) -> None:
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.eos_token_ids = eos_token_ids
        self.readback = Readback(runner.device, max_num_seqs)
        self.pending: Pending | None = None
        self.num_launched = 0  # forwards launched ahead of a read (the tests' witness that it ran)

    def _may_wait(self) -> bool:
        """Whether the waiting sequences (if any) could not be admitted now anyway: every seat is taken."""
        return not self.scheduler.waiting or len(self.scheduler.running) >= self.scheduler.max_num_seqs

    def startable(self) -> list[Sequence] | None:
        """After an ordinary step: the running sequences, if all are plain decodes of one kind with a
        token to go (the first forward ahead starts from their known last tokens). Not after a step that
        gave a sequence its first token: that token goes out without waiting for a launch (on a CPU,
        launching is computing)."""
        running = self.scheduler.running
        if not running or not self._may_wait() or len(running) > self.scheduler.max_num_batched_tokens:
            return None
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.num_output_tokens < 2 or seq.tokens_left(self.max_model_len) < 1:
                return None
        return list(running) if one_kind(running) is not None else None

    def steady(self, pending: Pending) -> bool:
        """May the forward after ``pending`` run ahead over the same sequences?"""
        seqs = pending.seqs
        if not self._may_wait() or len(self.scheduler.running) != len(seqs):
            return False
        # The pending token is the output's next one: two to go means one more after it. (Their kind
        # still holds: it depends on their parameters, and on min_tokens only until it is served.)
        return all(s.status is SequenceStatus.RUNNING and s.tokens_left(self.max_model_len) >= 2 for s in seqs)

    def launch(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> Pending | None:
        """Launch one decode forward over ``seqs`` at their next uncomputed position, its input ids
        ``input_ids`` (the pending forward's tokens, on the device) or else each one's last token.
        None, with nothing launched, where the KV pool cannot give every sequence its slot."""
        bm, copies, got = self.scheduler.bm, [], []
        for seq in seqs:
            got = bm.reserve(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + 1)
            if got is None:
                break
            copies.extend(got)
        # Copy-on-write copies made are copied even if no forward follows: the tables point at them now.
        self.runner.copy_blocks(copies)
        if got is None:  # slots reserved for the others stay theirs: the next ordinary step uses them
            return None
        chunks = [
            ForwardChunk(
                [0 if input_ids is not None else s.token_ids[-1]],
                s.num_computed_tokens,
                s.block_table,
                1,
                lora=s.lora_slot,
            )
            for s in seqs
        ]
        logits = self.runner.execute(self.runner.prepare(chunks), input_ids=input_ids).logits
        tokens = self._draw(seqs, one_kind(seqs), logits, ahead=int(input_ids is not None))
        self.num_launched += 1
        return Pending(seqs, tokens, self.readback.start(tokens))

    def _draw(self, seqs: list[Sequence], how: str, logits: torch.Tensor, ahead: int) -> torch.Tensor:
        """Each row's token, as an ordinary step draws it (``how``: their kind). ``ahead``: output tokens of
        each sequence still on the device (the pending one), before the one drawn here (its seeded noise's
        position)."""
        if how == "greedy":
            return logits.argmax(-1)
        n = len(seqs)
        md = SamplingMetadata.from_state(
            [s.params for s in seqs], [s.num_output_tokens + ahead for s in seqs], [None] * n, [None] * n,
            [s.noise_key(ahead) for s in seqs], self.eos_token_ids, self.runner.vocab_size, self.runner.device,
        )  # fmt: skip
        return sampled_tokens(logits, md, seeded=how == "seeded")
