"""From a forward's logits to accepted draft nodes, for a batch of samples (see ``step.py``).

Greedy samples take the fast path: one argmax per row and a walk on the host
(:func:`~engine.sampling.verify.greedy_accept`); sampling samples go through lossless
rejection sampling (:func:`~engine.sampling.verify.verify`), seeded ones through the
drafter-invariant rule; a request that asked for Medusa's typical acceptance (lossy) gets it.
Every row is shaped exactly as plain sampling would shape it — a node's row as if its path above
had been emitted — so penalties count the path's tokens too, and no-repeat n-grams see the path.
Penalty statistics live on the sequence, on the device, updated with each step's tokens: building a
row costs O(vocab), never O(context).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.staging import take_rows, to_device
from engine.request.sequence import Sequence
from engine.sampling.no_repeat import banned_tokens
from engine.sampling.sampler import (
    SamplingMetadata,
    exponential_noise,
    processed,
    processed_probs,
)
from engine.sampling.verify import build_verify_input, draw, greedy_accept, verify
from engine.structured import unpack


class RowsMetadata:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> None:
        self.vocab_size, self.device, self.eos_token_ids = vocab_size, device, eos_token_ids

    def __call__(self, samples: list) -> tuple[list[int], SamplingMetadata]:
        """Logits rows of every sample's root and nodes, and their sampling metadata."""
        rows, params, num_out, counts, masks, gens, extra, banned = [], [], [], [], [], [], [], []
        grammar_rows: list[tuple[int, torch.Tensor]] = []  # (first row, [rows, words] bitmask)
        for s in samples:
            seq = s.seq
            if seq.grammar is not None:
                grammar_rows.append((len(rows), s.grammar_masks(seq)))
            st = penalty_state(seq, self.vocab_size, self.device)
            paths: list[list[int]] = [[]]
            for t, par in zip(s.tree.tokens, s.tree.parents):
                paths.append(paths[par + 1] + [t])
            for i, path in enumerate(paths):
                extra.extend((len(rows), t) for t in path)
                rows.append(s.row + i)
                params.append(seq.params)
                num_out.append(seq.num_output_tokens + len(path))
                counts.append(st[0])
                masks.append(st[1])
                gens.append(seq.noise_key(len(path)))  # the noise of the position this row samples
                banned.append(banned_tokens(seq, path))
        extra = extra if any(p.needs_penalties for p in params) else []
        V, dev, eos = self.vocab_size, self.device, self.eos_token_ids
        forbidden = self._forbidden(len(rows), grammar_rows) if grammar_rows else None
        return rows, SamplingMetadata.from_state(
            params, num_out, counts, masks, gens, eos, V, dev, extra, banned, forbidden
        )

    def plain_rows(self, samples: list) -> list[int] | None:
        """The logits rows of every sample's root and nodes where no row needs a logits processor
        (no penalty, logit bias, ``min_tokens`` ban, n-gram ban or grammar): the greedy rule is then
        the raw logits' argmax, and no sampling metadata is built. None where some row needs one."""
        rows: list[int] = []
        for s in samples:
            seq, p = s.seq, s.seq.params
            if (
                seq.grammar is not None
                or p.needs_penalties
                or p.logit_bias
                or p.no_repeat_ngram_size
                or seq.num_output_tokens < p.min_tokens  # deeper rows have more outputs: none is banned
            ):
                return None
            rows.extend(range(s.row, s.row + len(s.tree) + 1))
        return rows

    def _forbidden(self, num_rows: int, grammar_rows: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """``[rows, V]`` bool: True where a grammar forbids the token (rows without one: nothing)."""
        words = grammar_rows[0][1].shape[1]
        packed = np.full((num_rows, words), -1, dtype=np.int32)  # all allowed
        for first, m in grammar_rows:  # (host bitmasks, from the grammar engine)
            packed[first : first + m.shape[0]] = m
        return ~unpack(to_device(packed, self.device, torch.int32), self.vocab_size)


def accept_greedy(samples: list, logits: torch.Tensor, rows_md: RowsMetadata) -> list[tuple[list[int], int]]:
    """(accepted node indices, final token) per greedy sample: the target's argmax decides."""
    rows = rows_md.plain_rows(samples)
    if rows is not None:
        return _walk(samples, take_rows(logits, rows).argmax(-1))
    rows, md = rows_md(samples)
    raw = take_rows(logits, rows)
    return _walk(samples, processed(raw, md).argmax(-1))


def sampled_tokens(raw: torch.Tensor, md: SamplingMetadata, seeded: bool) -> torch.Tensor:
    """Each row's token as plain sampling draws it, on the device (``[rows, V]`` logits → ``[rows]``):
    seeded rows ``argmax(p / E)`` with ``E`` the Exp(1) noise of (seed, position) alone, unseeded rows
    one inverse-CDF draw of ``p`` each. Run-ahead decoding (engine/core/ahead.py) draws with it too."""
    p = processed_probs(raw, md)
    if seeded:
        return (p / exponential_noise(p, md.generators)).argmax(-1)
    return draw(p, torch.rand(len(p), dtype=torch.float64, device=p.device))


def accept_seeded(samples: list, logits: torch.Tensor, rows_md: RowsMetadata) -> list[tuple[list[int], int]]:
    """(accepted node indices, final token) per seeded sampling sample, drafter-invariantly: each row's
    token is the target's own sample for that output position, ``argmax(p / E)`` with ``E`` the noise
    of (seed, position) alone, and a draft node is kept while it equals it. What is emitted is
    therefore exactly what plain decoding with that seed emits, whatever was drafted or batched; it
    is a sample of ``p`` because ``E`` is i.i.d. Exp(1) for every key."""
    rows, md = rows_md(samples)
    return _walk(samples, sampled_tokens(take_rows(logits, rows), md, seeded=True))


def _walk(samples: list, targets: torch.Tensor) -> list[tuple[list[int], int]]:
    """Keep each tree's nodes while they equal the target's token of their parent's row (one transfer)."""
    roots, r = [], 0
    for s in samples:
        roots.append(r)
        r += len(s.tree) + 1
    return greedy_accept(targets.tolist(), [s.tree for s in samples], roots)


def accept_random(samples: list, logits: torch.Tensor, rows_md: RowsMetadata) -> list[tuple[list[int], int]]:
    """(accepted node indices, final token) per unseeded sampling sample, by lossless rejection sampling."""
    rows, md = rows_md(samples)
    raw = take_rows(logits, rows)
    if not any(len(s.tree) for s in samples):  # plain sampling: one draw a row, nothing to verify
        return [([], t) for t in sampled_tokens(raw, md, seeded=False).tolist()]
    p = processed_probs(raw, md)
    inp, roots = build_verify_input(p, [s.tree for s in samples], rows_md.vocab_size)
    res = verify(inp)
    accepted = [[r - root - 1 for r in acc] for acc, root in zip(res.accepted_rows, roots)]
    return list(zip(accepted, res.final_tokens))


def accept_typical(samples: list, logits: torch.Tensor, rows_md: RowsMetadata) -> list[tuple[list[int], int]]:
    """LOSSY (Medusa's typical acceptance, asked for per request): a node ``x`` under a row whose
    shaped target distribution is ``p`` is *typical* when ``p(x) > min(epsilon, delta * exp(-H(p)))``;
    the deepest path of typical nodes is accepted (the first such in the tree's order), and the final
    token is sampled from ``p`` at its end. Accepts more than rejection sampling where ``p`` is flat,
    at the price of exactness: the output is not the target's distribution."""
    rows, md = rows_md(samples)
    raw = take_rows(logits, rows)
    p = processed_probs(raw, md)  # [R, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [R]
    eps_delta = [s.seq.params.typical_acceptance for s in samples for _ in range(len(s.tree) + 1)]
    eps, delta = to_device(eps_delta, p.device, torch.float32).unbind(-1)
    threshold = torch.minimum(eps, delta * torch.exp(-entropy))  # [R]
    parent_rows, tokens, r = [], [], 0
    for s in samples:
        parent_rows.extend(r + par + 1 for par in s.tree.parents)
        tokens.extend(s.tree.tokens)
        r += len(s.tree) + 1
    par, tok = to_device([parent_rows, tokens], p.device, torch.int64)
    typical = p[par, tok] > threshold[par]  # [nodes]
    draws = (p / exponential_noise(p, md.generators)).argmax(-1)  # [R] a sample of p at every row
    host = torch.cat([typical.long(), draws]).tolist()  # one transfer
    typical, draws = host[: len(tokens)], host[len(tokens) :]
    out, node, r = [], 0, 0
    for s in samples:
        n = len(s.tree)
        depth = [0] * n  # depth of node i if its whole path is typical, else 0
        for i, parent in enumerate(s.tree.parents):
            if typical[node + i] and (parent < 0 or depth[parent]):
                depth[i] = (depth[parent] if parent >= 0 else 0) + 1
        best = max(range(n), key=lambda i: (depth[i], -i), default=None)
        path: list[int] = []
        i = best if best is not None and depth[best] else -1
        while i >= 0:
            path.append(i)
            i = s.tree.parents[i]
        path.reverse()
        out.append((path, draws[r + (path[-1] + 1 if path else 0)]))
        node, r = node + n, r + n + 1
    return out


def acceptance_kind(sample) -> str:
    """Which rule verifies a sample: greedy, seeded (drafter-invariant), random (rejection sampling),
    or typical (lossy, only when the request asked for it and there is a draft)."""
    p = sample.seq.params
    if p.greedy:
        return "greedy"
    if p.typical_acceptance is not None and len(sample.tree):
        return "typical"
    return "seeded" if sample.seq.seed is not None else "random"


ACCEPT = {"greedy": accept_greedy, "seeded": accept_seeded, "random": accept_random, "typical": accept_typical}


def penalty_state(seq: Sequence, vocab_size: int, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """A penalised sequence's ``[V]`` output-token counts and prompt mask, built once from its
    history and then kept up to date by :func:`count_tokens`."""
    p = seq.params
    if not p.needs_penalties:
        return None, None
    if seq.token_counts is None:
        seq.token_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        count_tokens(seq, seq.output_ids, vocab_size)
        if p.repetition_penalty != 1.0:
            seq.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in seq.prompt_ids if 0 <= t < vocab_size]
            seq.prompt_mask[to_device(ids, device, torch.int64)] = True
    return seq.token_counts, seq.prompt_mask


def count_tokens(seq: Sequence, tokens: list[int], vocab_size: int) -> None:
    if seq.token_counts is not None and tokens:
        dev = seq.token_counts.device
        idx = to_device([t for t in tokens if 0 <= t < vocab_size], dev, torch.int64)
        seq.token_counts.index_put_((idx,), torch.ones((), device=dev), accumulate=True)
