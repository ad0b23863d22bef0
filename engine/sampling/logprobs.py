"""Logprobs a client asked for, gathered from a forward's raw logits in a few batched ops.

Reported logprobs are of the *raw* model distribution (``log_softmax`` of the unprocessed logits),
whatever temperature, filters or penalties chose the token, as vLLM reports them by default.
"""

from __future__ import annotations

import torch

from engine.attention.staging import take_rows, to_device
from engine.request.confine import Confine
from engine.request.sequence import Sequence, TokenLogprob
from engine.runner.readback import to_host


class LogprobRows:
    """Logprobs of a forward's rows for several requests: gathered for all of them in a few batched ops
    and one transfer, then handed to each request (:meth:`of`), one by one (a failure in one request's
    share fails that request alone: engine/request/confine.py)."""

    def __init__(
        self,
        logits: torch.Tensor,  # [N, V] raw logits of the forward
        requests: list[tuple[list[int], list[int], int]],  # per request: (rows, tokens drawn at them, top k)
    ) -> None:
        self.requests = requests
        self.first = [0]  # each request's first gathered row
        for rs, _, _ in requests:
            self.first.append(self.first[-1] + len(rs))
        self.chosen = self.top_v = self.top_i = None
        if not requests:
            return
        rows = [r for rs, _, _ in requests for r in rs]
        tokens = [t for _, ts, _ in requests for t in ts]
        lp = torch.log_softmax(take_rows(logits, rows).float(), dim=-1)  # [R, V]
        chosen = lp.gather(1, to_device(tokens, lp.device, torch.int64)[:, None])[:, 0]
        k = max(k for *_, k in requests)
        if k > 0:
            v, i = lp.topk(min(k, lp.shape[1]), dim=-1)
            self.chosen, self.top_v, self.top_i = to_host(chosen, v, i)  # one transfer
        else:
            (self.chosen,) = to_host(chosen)

    def of(self, i: int) -> list[TokenLogprob]:
        """Request ``i``'s logprob of each token at its rows, with its ``k`` best alternatives."""
        _, ts, k = self.requests[i]
        out = []
        for j, tok in enumerate(ts, self.first[i]):
            top = list(zip(self.top_i[j][:k], self.top_v[j][:k])) if k and self.top_i is not None else []
            out.append(TokenLogprob(tok, self.chosen[j], top))
        return out


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether a prefill chunk of ``seq`` starting at ``start`` must return logits for every token."""
    group = seq.group
    return (
        seq.params.prompt_logprobs is not None
        and seq.index == 0
        and len(group.prompt_logprobs) < group.num_prompt_tokens
        and start < group.num_prompt_tokens
    )


def record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, int, int, int]], confine: Confine) -> None:
    """Logprob of each prompt token given the tokens before it, with the top alternatives.

    ``spans``: (sequence, first logits row, first position, count) of prefill chunks that asked for
    them; results are appended to the request's ``prompt_logprobs`` (``None`` for the first token,
    which nothing predicts)."""
    per_seq: list[tuple[list[int], list[int], int]] = []
    owners = []
    for seq, first_row, start, n in spans:
        group = seq.group
        if start == 0 and not group.prompt_logprobs:
            group.prompt_logprobs.append(None)
        # the logits at `pos` predict the token at pos + 1; positions scored already (before a
        # preemption made the prompt be recomputed) are not scored twice
        first = max(start, len(group.prompt_logprobs) - 1)
        pos = [p for p in range(first, start + n) if p + 1 < group.num_prompt_tokens]
        if pos:
            rows = [first_row + p - start for p in pos]
            per_seq.append((rows, [seq.token_ids[p + 1] for p in pos], seq.params.prompt_logprobs))
            owners.append(group)
    rows = LogprobRows(logits, per_seq)
    for i, group in enumerate(owners):
        if (lps := confine.run(group, rows.of, i)) is not None:
            group.prompt_logprobs.extend(lps)
