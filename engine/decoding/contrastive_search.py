"""Contrastive search (Su et al., 2022): confident tokens that do not repeat what was already said.

Each step of a request with ``penalty_alpha`` (alpha) and ``top_k`` (k):

1. its *candidates* are the k most likely next tokens, ``p`` being the softmax of its next-token
   logits after the logits processors (penalties, bias, no-repeat n-grams; no temperature);
2. every candidate is fed at once, as k siblings at the same position (a one-level tree: each sees
   the context and itself), which gives each its final-normed hidden state ``h`` and the logits of
   the token after it;
3. the chosen candidate maximises ``(1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)`` over the
   hidden states ``h_j`` of every token before it (prompt and output): the *degeneration penalty*;
4. its K/V moves to the sequence's next slot and its logits row drives the next step.

So a token costs one target forward of k tokens and no other, and the chosen token's logits come
from that same forward. The context's hidden states are kept on the device, unit-normed, one row
per token (computed by the prefill, so a request's prompt is never taken from the prefix cache).
Contrastive search is deterministic and never speculated.

The k candidates may be *fed over several steps*, a part in each, when the scheduler gives the
request less than k tokens of a step (its fair share: engine/core/scheduler.py). Each part's
candidates sit in the slots after the ones fed before, still at the same position, and see the
context but not those (the mask's columns over them are empty); the best candidate so far is kept
(its score, logits row and hidden state), and the token is chosen when the last part is in. A
candidate's score depends on its own forward and the context alone, and ties go to the earlier
candidate either way, so the choice is the one all k at once would make.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request.confine import Confine
from engine.request.sequence import Sequence
from engine.request.state import SearchState
from engine.runner.model_runner import ForwardChunk
from engine.runner.readback import to_host
from engine.sampling.batch import Sample
from engine.sampling.sampler import processed
from engine.sampling.tree import DraftTree


@dataclass
class Fed:
    """Candidates of one sequence in this step's forward: ``tokens`` are candidates ``first ..`` of its k."""

    seq: Sequence
    row: int  # logits row of this part's first candidate (candidate first + i: row + i)
    tok: int  # flat token index of this part's first candidate
    tokens: list[int]
    first: int = 0
    chosen: int | None = None  # once the last part is in: the candidate chosen (of the k) ...
    token: int | None = None  # ... and its token


class ContrastiveSearch:
    def record(self, seq: Sequence, start: int, final: torch.Tensor) -> None:
        """The final hidden states ``[n, H]`` of tokens ``start .. start + n`` (a prefill chunk, a
        recompute) join the context; a prefill from 0 starts it afresh."""
        st = seq.search
        if start == 0:
            st.length = 0
        _append(st, torch.nn.functional.normalize(final.float(), dim=-1))
        st.start_token(None)

    def candidates(self, seqs: list[Sequence], rows_md) -> None:
        """Each sequence's k candidates for its next token, best first, and their probabilities (one
        transfer for all)."""
        if not seqs:
            return
        _, md = rows_md([Sample(s, DraftTree(), i, 0) for i, s in enumerate(seqs)])
        logits = torch.stack([s.search.next_logits for s in seqs])  # [B, V]
        probs = torch.softmax(processed(logits, md), dim=-1)
        k = max(s.params.top_k for s in seqs)
        top, ids = probs.topk(k, dim=-1)  # [B, k]
        for s, p, t in zip(seqs, top, ids.tolist()):
            s.search.probs = p[: s.params.top_k]
            s.search.tokens = t[: s.params.top_k]

    @staticmethod
    def chunk(seq: Sequence, n: int) -> ForwardChunk:
        """Its next ``n`` candidates side by side at the next position, after the ones fed before in the
        slots, each seeing the context and itself."""
        st, c = seq.search, seq.num_computed_tokens
        mask = torch.zeros(n, st.fed + n, dtype=torch.bool)
        mask[:, st.fed :] = torch.eye(n, dtype=torch.bool)
        tokens = st.tokens[st.fed : st.fed + n]
        return ForwardChunk(tokens, c + st.fed, seq.block_table, n, [c] * n, mask, mask_start=c, lora=seq.lora_slot)

    def choose(self, fed: list[Fed], logits: torch.Tensor, final: torch.Tensor, confine: Confine) -> list[Fed]:
        """Score each part's candidates and keep each sequence's best so far; pick the candidate of those
        whose last part is in (``Fed.chosen``) and move them on to their next token. Returns those (a
        sequence whose scoring raises fails alone)."""
        scored = [(f, s) for f in fed if (s := confine.run(f.seq.group, self._score, f, final)) is not None]
        if not scored:
            return []
        best = torch.stack([s.argmax() for _, s in scored])
        values = torch.stack([s[b] for (_, s), b in zip(scored, best)])
        done = []
        for (f, _), i, v in zip(scored, *to_host(best, values)):  # one transfer
            if confine.run(f.seq.group, self._keep, f, int(i), float(v), logits, final):
                done.append(f)
        return done

    @staticmethod
    def _score(f: Fed, final: torch.Tensor) -> torch.Tensor:
        """``[n]`` each candidate's score: its probability less the degeneration penalty."""
        st, alpha, n = f.seq.search, f.seq.params.penalty_alpha, len(f.tokens)
        h = torch.nn.functional.normalize(final[f.tok : f.tok + n].float(), dim=-1)  # [n, H]
        penalty = (h @ st.context[: st.length].T).amax(dim=-1)  # [n] closest earlier token, by cosine
        probs = st.probs[f.first : f.first + n]
        score = (1.0 - alpha) * probs - alpha * penalty
        # A candidate of probability 0 (fewer allowed tokens than top_k: a grammar, a ban) is never picked.
        return score.masked_fill(probs <= 0, float("-inf"))

    @staticmethod
    def _keep(f: Fed, i: int, value: float, logits: torch.Tensor, final: torch.Tensor) -> bool:
        """Keep this part's best candidate (``i``) if it beats the parts' before (a tie keeps the earlier);
        after the last part, choose. Whether the token was chosen."""
        st = f.seq.search
        last = f.first + len(f.tokens) == len(st.tokens)
        if st.best is None or value > st.best[0]:
            row, h = logits[f.row + i], final[f.tok + i : f.tok + i + 1]
            st.best = (value, f.first + i, row, h) if last else (value, f.first + i, row.clone(), h.clone())
        st.fed = f.first + len(f.tokens)
        if not last:
            return False
        _, f.chosen, row, h = st.best
        f.token = st.tokens[f.chosen]
        _append(st, torch.nn.functional.normalize(h.float(), dim=-1))
        st.start_token(row)
        return True


def _append(st: SearchState, rows: torch.Tensor) -> None:
    """Add ``[n, H]`` rows to the context, doubling its storage when full (amortised O(n) a step, not a
    copy of the whole context)."""
    end = st.length + rows.shape[0]
    if st.context is None or end > st.context.shape[0]:
        grown = rows.new_empty((max(end, 2 * st.length, 64), rows.shape[1]))
        if st.length:
            grown[: st.length] = st.context[: st.length]
        st.context = grown
    st.context[st.length : end] = rows
    st.length = end
