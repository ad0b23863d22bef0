"""Beam search inside continuous batching, step for step what transformers' ``generate(num_beams=…)`` does.

A beam request (``use_beam_search``) is a group of ``width`` sequences, its *beams*, decoded side by
side with every other request. Terms:

* *score* of a running beam: the sum of its tokens' log-probabilities, each taken from
  ``log_softmax`` of the raw logits and then shaped by the request's logits processors (penalties,
  logit bias, min_tokens, no-repeat n-grams), transformers' order;
* *candidate*: a running beam followed by one more token; each step keeps the best
  ``K = max(2, 1 + stop tokens) * width`` candidates of all beams;
* *hypothesis*: a finished candidate (EOS or a stop token id, a stop string, the length limit),
  scored ``score / generated_tokens ** length_penalty``; the best ``width`` are kept.

One step of a group, once every running beam has its logits row (a beam whose row arrives before
its mates' — the token budget or a preemption split them — is parked with no token to feed):
candidates that finish, among the best ``width``, become hypotheses; the best ``width`` that do
not are the next beams. A beam chosen more than once is forked (its KV blocks shared,
copy-on-write); one chosen by nobody is freed. The search ends when no running beam can beat the
worst kept hypothesis (``early_stopping`` False: at its current length; ``"never"``: at the
longest length it may reach, when the length penalty favours length), when ``width`` hypotheses
are kept and ``early_stopping`` is True, or when every candidate finished. The ``n`` best
hypotheses are the request's choices. Beams never speculate: their logits rows feed a ranking,
not a sample, and a draft could only save forwards by guessing every beam's path, which no
proposer here does losslessly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.staging import take_rows, to_device
from engine.request.confine import Confine
from engine.request.sequence import FinishReason, Hypothesis, Sequence, SequenceGroup, SequenceStatus
from engine.runner.readback import to_host
from engine.sampling.sampler import apply_logits_processors

_LOST = -1.0e9  # transformers' score for a candidate that may not be chosen
_LOG_MAX = math.log(sys.float_info.max)


@dataclass
class _Candidate:
    score: float
    parent: int  # index of its beam in group.seqs
    token: int
    finish: FinishReason | None = None
    stop_reason: int | str | None = None
    detok: object = None  # the parent's detokenizer with the token appended, when it was needed
    by_token: bool = False  # finished by EOS or a stop token id (which, as in plain decoding, is no text)


def length_normed(score: float, length: int, penalty: float) -> float:
    """``score / length ** penalty``, a hypothesis' score as transformers computes it, where the power is
    a float; where it is not (1300 ** 100 overflows, 2000 ** -100 is 0), the quotient in log space,
    which is then 0 or beyond every float and saturates there (at ±0 or ±inf) instead of raising."""
    try:
        norm = length**penalty
    except OverflowError:
        norm = math.inf
    if 0.0 < norm < math.inf:
        return score / norm
    if score == 0.0:
        return score
    log = math.log(abs(score)) - penalty * math.log(length)
    return math.copysign(math.exp(log) if log < _LOG_MAX else math.inf, score)


class BeamSearch:
    def __init__(
        self,
        eos_token_ids: list[int],
        max_model_len: int,
        fork: Callable[[Sequence], Sequence],  # a new sequence sharing the parent's tokens and KV blocks
        finish: Callable[[Sequence], None],  # frees a sequence's KV blocks and proposer state
    ) -> None:
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.fork, self.finish = fork, finish

    def accept(self, samples: list, logits: torch.Tensor, rows_md, confine: Confine) -> list[SequenceGroup]:
        """Take the beams' logits rows of this step; run the step of every group whose beams all have
        theirs, each on its own (a group whose step raises fails alone). Returns the groups whose search
        ended (their choices are ``group.seqs``)."""
        rows, md = rows_md(samples)
        scores = torch.log_softmax(take_rows(logits, rows).float(), dim=-1)  # [B, V]
        if md.needs_processing:
            scores = apply_logits_processors(scores, md)
        groups: dict[str, SequenceGroup] = {}
        for s, row in zip(samples, scores):
            group = s.seq.group
            group.beam.rows[s.seq.seq_id] = row
            s.seq.parked = True
            groups[group.request_id] = group
        ended = []
        for group in groups.values():
            if group.error is None and all(b.seq_id in group.beam.rows for b in group.seqs):
                if confine.run(group, self._step, group):
                    ended.append(group)
        return ended

    def _step(self, group: SequenceGroup) -> bool:
        st, p, beams = group.beam, group.params, group.seqs
        width = p.beam_width
        vocab = st.rows[beams[0].seq_id].shape[0]
        total = torch.stack([st.rows.pop(b.seq_id) for b in beams])  # [k, V]
        for b in beams:
            b.parked = False
        total += to_device(st.scores, total.device, torch.float32).unsqueeze(1)
        stops = (set() if p.ignore_eos else self.eos) | set(p.stop_token_ids)
        k = min(max(2, 1 + len(stops)) * width, total.numel())
        values, index = total.flatten().topk(k)
        cands = [_Candidate(v, i // vocab, i % vocab) for v, i in zip(*to_host(values, index))]  # one transfer

        generated = beams[0].num_output_tokens + 1  # every running beam has the same length
        limit = self._max_generated(beams[0])
        running: list[_Candidate] = []
        for j, c in enumerate(cands):  # finish checks in rank order, as far as the choices need them
            if len(running) == width and j >= width:
                break
            self._check(c, beams[c.parent], generated >= limit)
            if c.finish is None and len(running) < width:
                running.append(c)

        # The best `width` candidates that finished become hypotheses (unless the search is settled).
        full = len(st.finished) == width
        if st.improvable and not (full and p.early_stopping is True):
            lp = p.length_penalty
            new = [
                Hypothesis(length_normed(c.score, generated, lp), self._hypothesis(group, beams[c.parent], c))
                for c in cands[:width]
                if c.finish
            ]
            st.finished = sorted(st.finished + new, key=lambda h: -h.score)[:width]
        full = len(st.finished) == width
        if running and full:
            best = max(c.score for c in running)
            length = limit if p.early_stopping == "never" and p.length_penalty > 0 else generated
            st.improvable = st.improvable and length_normed(best, length, p.length_penalty) > st.finished[-1].score
        if not running or not st.improvable or (full and p.early_stopping is True):
            self._end(group)
            return True
        self._advance(group, running)
        return False

    def _max_generated(self, seq: Sequence) -> int:
        """The most tokens any beam of this request may generate (max_tokens, the context)."""
        room = self.max_model_len - seq.num_prompt_tokens
        return room if seq.params.max_tokens is None else min(room, seq.params.max_tokens)

    def _check(self, c: _Candidate, parent: Sequence, at_limit: bool) -> None:
        """Does the candidate finish? The same checks, in the same order, as plain decoding's."""
        p = parent.params
        if c.token in self.eos and not p.ignore_eos:
            c.finish, c.by_token = FinishReason.STOP, True
            return
        if c.token in p.stop_token_ids:
            c.finish, c.by_token, c.stop_reason = FinishReason.STOP, True, c.token
            return
        if p.stop:
            c.detok = parent.detok.fork()
            matched = c.detok.append([c.token], parent.num_output_tokens + 1 >= p.min_tokens)
            if matched is not None:
                c.finish, c.stop_reason = FinishReason.STOP, matched
                return
        if at_limit:
            c.finish = FinishReason.LENGTH

    def _hypothesis(self, group: SequenceGroup, parent: Sequence, c: _Candidate) -> Sequence:
        h = Sequence(group, parent.prompt_ids)
        h.token_ids = parent.token_ids + [c.token]
        h.detok = c.detok
        if h.detok is None:
            h.detok = parent.detok.fork()
            if not c.by_token:
                h.detok.append([c.token])
        h.status, h.finish_reason, h.stop_reason = SequenceStatus.FINISHED, c.finish, c.stop_reason
        return h

    def _advance(self, group: SequenceGroup, running: list[_Candidate]) -> None:
        """The chosen candidates become the running beams: a parent chosen once continues as that
        beam, one chosen again is forked first, one not chosen is freed."""
        beams, used = group.seqs, set()
        seqs = []
        for c in running:  # every fork before any parent changes
            seqs.append(beams[c.parent] if c.parent not in used else self.fork(beams[c.parent]))
            used.add(c.parent)
        for i, b in enumerate(beams):
            if i not in used:
                self.finish(b)
        for seq, c in zip(seqs, running):
            seq.token_ids.append(c.token)
            if seq.grammar is not None:  # structured outputs: each beam's grammar follows its tokens
                seq.grammar.advance([c.token])
            if c.detok is not None:
                seq.detok = c.detok
            else:
                seq.detok.append([c.token])
            if seq.token_counts is not None:
                seq.token_counts[c.token] += 1
        for i, seq in enumerate(seqs):
            seq.index = i
        group.seqs = seqs
        group.beam.scores = [c.score for c in running]

    def _end(self, group: SequenceGroup) -> None:
        """The search is over: free the running beams; the best ``n`` hypotheses are the choices."""
        st = group.beam
        for b in group.seqs:
            self.finish(b)
        chosen = [h.seq for h in st.finished[: group.params.n]]
        for i, seq in enumerate(chosen):
            seq.index = i
        group.seqs = chosen
        st.rows.clear()
