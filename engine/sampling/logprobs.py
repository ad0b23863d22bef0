"""Logprobs a client asked for, gathered from a forward's raw logits in a few batched ops.

Reported logprobs are of the *raw* model distribution (``log_softmax`` of the unprocessed logits),
whatever temperature, filters or penalties chose the token, as vLLM reports them by default.
"""

from __future__ import annotations

import torch

from engine.attention.staging import take_rows, to_device
from engine.request.sequence import Sequence, TokenLogprob
from engine.runner.readback import to_host


def token_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits of the forward
    requests: list[tuple[list[int], list[int], int]],  # per request: (rows, tokens drawn at them, top k)
) -> list[list[TokenLogprob]]:
    """For each request, the logprob of each token at its row and the ``k`` best alternatives."""
    if not requests:
        return []
    rows = [r for rs, _, _ in requests for r in rs]
    tokens = [t for _, ts, _ in requests for t in ts]
    lp = torch.log_softmax(take_rows(logits, rows).float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, to_device(tokens, lp.device, torch.int64)[:, None])[:, 0]
    k = max(k for *_, k in requests)
    top_v = top_i = None
    if k > 0:
        v, i = lp.topk(min(k, lp.shape[1]), dim=-1)
        chosen, top_v, top_i = to_host(chosen, v, i)  # one transfer
    else:
        (chosen,) = to_host(chosen)
    out, j = [], 0
    for _, ts, kk in requests:
        lps = []
        for tok in ts:
            top = list(zip(top_i[j][:kk], top_v[j][:kk])) if kk and top_i is not None else []
            lps.append(TokenLogprob(tok, chosen[j], top))
            j += 1
        out.append(lps)
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


def record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]) -> None:
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
    for group, lps in zip(owners, token_logprobs(logits, per_seq)):
        group.prompt_logprobs.extend(lps)
