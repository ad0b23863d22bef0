"""Batched token sampling: logits processors, the sampling distribution, and the draw.

One batch mixes requests with different parameters, so every per-request setting becomes a row of a
flat tensor (:class:`SamplingMetadata`) and every step below is a handful of batched tensor ops with
no loop over the vocabulary and no host sync inside the math. Work that no row needs is skipped by
leaving its tensor ``None`` (decided once, on the host, in :meth:`SamplingMetadata.build`).

Terms used throughout:

* *raw logits*: the model's output for a row, ``[B, V]`` float32.
* *processed logits*: raw logits after penalties, logit bias and suppression
  (:func:`apply_logits_processors`).
* *sampling distribution*: the exact distribution a row draws its token from
  (:func:`compute_probs`): temperature, then top-k, top-p, min-p, renormalised; a one-hot at the
  argmax for greedy rows. Speculative rejection sampling uses this same distribution as the target
  ``p``, which is why it is a function of its own rather than fused into the draw.
* *greedy row*: a row whose temperature is 0; it takes the argmax and consumes no randomness.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.staging import ring, to_device
from engine.request.sampling_params import NoiseKey, SamplingParams
from engine.sampling.no_repeat import banned_in

# Smallest positive float32: exponential draws are clamped to it so that ``0 / 0`` never makes a NaN.
_TINY = torch.finfo(torch.float32).tiny
_MIN_REPETITION_PENALTY = 1e-30


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one batch; one row per logits row.

    A sequence may own several rows (one per verified position in speculative decoding), so
    nothing here assumes one row per request. All tensors live on the logits' device.

    ``None`` means "no row needs this", and the corresponding work is skipped. Filters are only
    considered for random rows (a greedy row's argmax does not depend on them); penalties, logit
    bias and suppression apply to greedy rows too, since they change which token is the argmax.

    ``max_num_logprobs`` mirrors :attr:`SamplingParams.logprobs`: ``-1`` when no row asked for
    logprobs; otherwise the largest ``k`` any row asked for, where ``0`` means "the sampled token's
    logprob only" and ``k > 0`` means "sampled token plus the top ``k`` alternatives". Rows that
    asked for fewer than ``k`` (or none) slice what they need from :class:`SamplerOutput`.
    """

    temperature: torch.Tensor  # [B] float32, exactly 0.0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64; rows with top-k off hold vocab_size. None if no row uses it
    top_p: torch.Tensor | None  # [B] float32; rows with top-p off hold 1.0. None if no row uses it
    min_p: torch.Tensor | None  # [B] float32; rows with min-p off hold 0.0. None if no row uses it
    # Penalties: all three are None together, when no row uses any penalty; neutral rows hold 1/0/0.
    repetition_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    # [B, V] bool: token occurs in the row's prompt. Only the repetition penalty reads prompts, so this
    # is None when no row has one, and rows without one are left all False.
    prompt_mask: torch.Tensor | None
    # [B, V] float32 (exact integers): occurrences of each token in the row's output so far. Not None
    # whenever the penalties are; rows without penalties are left all zero. float32 so the frequency
    # penalty needs no cast per step.
    output_counts: torch.Tensor | None
    logit_bias: torch.Tensor | None  # [B, V] float32 additive; None if no row has a bias
    # [B, V] bool: tokens forbidden this step (EOS and stop ids while the row has fewer than
    # min_tokens outputs, tokens that would repeat an n-gram, tokens a grammar forbids); None if no
    # row has any.
    suppress_mask: torch.Tensor | None
    # Per row; a row with a generator draws its randomness only from it (on the logits' device).
    generators: list[torch.Generator | None]
    max_num_logprobs: int = -1  # see class docstring: -1 none, 0 sampled only, k sampled + top-k

    @property
    def needs_processing(self) -> bool:
        """Whether any row has a penalty, a logit bias or a suppressed token."""
        return self.repetition_penalty is not None or self.logit_bias is not None or self.suppress_mask is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Turn one batch's per-row parameters and token history into device tensors.

        All decisions about which work to skip are made here, on host values, so the sampling math
        never has to inspect a device tensor. Token ids outside ``[0, vocab_size)`` (in logit_bias
        keys, stop ids, or history) are ignored rather than trusted: validation belongs to the
        server, and a stray id must never write into a neighbouring row of a flat tensor.

        Greedy rows' generators are dropped (set to ``None``): a greedy row consumes no randomness,
        so a seeded greedy request leaves its generator untouched.
        """
        batch = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == batch):
            raise ValueError(
                f"params, prompt_ids, output_ids and generators must have one entry per row; got "
                f"{batch}, {len(prompt_ids)}, {len(output_ids)}, {len(generators)}"
            )
        device = torch.device(device)
        repetition = presence = frequency = prompt_mask = output_counts = None
        penalised = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalised:
            repetition, presence, frequency = _penalty_rows(params, device)
            flat = to_device(_flat_token_index(penalised, output_ids, vocab_size), device, torch.int64)  # [N]
            output_counts = torch.zeros(batch * vocab_size, dtype=torch.float32, device=device)
            # index_put_ with accumulate has a deterministic CUDA path; sums of 1.0 are exact anyway.
            output_counts.index_put_((flat,), torch.ones((), device=device), accumulate=True)
            output_counts = output_counts.view(batch, vocab_size)
            repeating = [i for i in penalised if params[i].repetition_penalty != 1.0]
            if repeating:
                flat = to_device(_flat_token_index(repeating, prompt_ids, vocab_size), device, torch.int64)
                prompt_mask = torch.zeros(batch * vocab_size, dtype=torch.bool, device=device)
                prompt_mask[flat] = True
                prompt_mask = prompt_mask.view(batch, vocab_size)
        penalties = (repetition, presence, frequency, prompt_mask, output_counts)
        num_outputs = [len(o) for o in output_ids]
        banned = [
            banned_in(list(prompt_ids[i]) + list(output_ids[i]), p.no_repeat_ngram_size)
            if p.no_repeat_ngram_size
            else ()
            for i, p in enumerate(params)
        ]
        return cls._assemble(params, num_outputs, generators, eos_token_ids, vocab_size, device, penalties, banned)

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of a subset of rows (a drafting level where some sequences stopped early)."""
        if len(rows) == self.temperature.shape[0]:
            return self
        idx = to_device(rows, self.temperature.device, torch.int64)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        # A subset of a mixed batch keeps the mixed flags: slower paths, the same results.
        return SamplingMetadata(
            temperature=pick(self.temperature),
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            repetition_penalty=pick(self.repetition_penalty),
            presence_penalty=pick(self.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty),
            prompt_mask=pick(self.prompt_mask),
            output_counts=pick(self.output_counts),
            logit_bias=pick(self.logit_bias),
            suppress_mask=pick(self.suppress_mask),
            generators=[self.generators[r] for r in rows],
            max_num_logprobs=self.max_num_logprobs,
        )

    @classmethod
    def from_state(
        cls,
        params: Sequence[SamplingParams],
        num_outputs: Sequence[int],
        counts: Sequence[torch.Tensor | None],  # per row [V] float32 output-token counts (penalised rows)
        prompt_masks: Sequence[torch.Tensor | None],  # per row [V] bool prompt tokens (repetition penalty)
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        extra_tokens: Sequence[tuple[int, int]] = (),  # (row, token): one more occurrence in that row
        banned: Sequence[Iterable[int]] = (),  # per row (or none): tokens no_repeat_ngram_size forbids
        forbidden: torch.Tensor | None = None,  # [B, V] bool: tokens a grammar forbids (structured outputs)
    ) -> SamplingMetadata:
        """Like :meth:`build`, from token statistics each sequence keeps up to date instead of its
        whole history: the cost is O(rows × vocab), never O(context). ``extra_tokens`` adds tokens a
        row has beyond its sequence's (a draft tree's path above a verified node)."""
        device = torch.device(device)
        repetition = presence = frequency = prompt_mask = output_counts = None
        if any(p.needs_penalties for p in params):
            repetition, presence, frequency = _penalty_rows(params, device)
            zeros = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            output_counts = torch.stack([c if c is not None else zeros for c in counts])  # [B, V]
            if extra_tokens:
                idx = to_device([list(x) for x in zip(*extra_tokens)], device, torch.int64)  # [2, N]
                output_counts.index_put_((idx[0], idx[1]), torch.ones((), device=device), accumulate=True)
            if any(m is not None for m in prompt_masks):
                none = torch.zeros(vocab_size, dtype=torch.bool, device=device)
                prompt_mask = torch.stack([m if m is not None else none for m in prompt_masks])
        penalties = (repetition, presence, frequency, prompt_mask, output_counts)
        return cls._assemble(
            params, num_outputs, generators, eos_token_ids, vocab_size, device, penalties, banned, forbidden
        )

    @classmethod
    def _assemble(
        cls,
        params: Sequence[SamplingParams],
        num_outputs: Sequence[int],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
        penalties: tuple[torch.Tensor | None, ...],  # repetition, presence, frequency, prompt_mask, output_counts
        banned: Sequence[Iterable[int]] = (),  # per row: tokens set to -inf (no-repeat n-grams)
        forbidden: torch.Tensor | None = None,  # [B, V] bool: also set to -inf (a grammar's mask)
    ) -> SamplingMetadata:
        repetition, presence, frequency, prompt_mask, output_counts = penalties
        batch = len(params)
        greedy = [p.greedy for p in params]
        temps, ks, ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy, strict=True):
            temps.append(0.0 if g else p.temperature)
            ks.append(p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size)
            ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
        # The rows' knobs in one copy from the device's pinned ring (engine/attention/staging.py).
        pack = ring(torch.device(device)).pack()
        staged = [
            pack.add(np.asarray(temps, dtype=np.float32)),
            pack.add(np.asarray(ks, dtype=np.int64)) if any(k < vocab_size for k in ks) else None,
            pack.add(np.asarray(ps, dtype=np.float32)) if any(x < 1.0 for x in ps) else None,
            pack.add(np.asarray(min_ps, dtype=np.float32)) if any(x > 0.0 for x in min_ps) else None,
        ]
        pack.send()
        temperature, top_k, top_p, min_p = (None if i is None else pack[i] for i in staged)

        bias_rows, bias_tokens, bias_values = [], [], []
        for i, p in enumerate(params):
            for tok, value in (p.logit_bias or {}).items():
                if 0 <= tok < vocab_size:
                    bias_rows.append(i)
                    bias_tokens.append(tok)
                    bias_values.append(value)
        logit_bias = None
        if bias_rows:
            logit_bias = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            index = to_device([bias_rows, bias_tokens], device, torch.int64)  # [2, N]
            logit_bias[index[0], index[1]] = to_device(bias_values, device, torch.float32)

        # min_tokens: EOS is suppressed even with ignore_eos, which only changes when a row stops.
        sup_rows, sup_tokens = [], []
        for i, p in enumerate(params):
            if num_outputs[i] < p.min_tokens:
                for tok in set(eos_token_ids).union(p.stop_token_ids):
                    if 0 <= tok < vocab_size:
                        sup_rows.append(i)
                        sup_tokens.append(tok)
        for i, toks in enumerate(banned):
            for tok in toks:
                if 0 <= tok < vocab_size:
                    sup_rows.append(i)
                    sup_tokens.append(tok)
        suppress_mask = None
        if sup_rows:
            suppress_mask = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
            index = to_device([sup_rows, sup_tokens], device, torch.int64)  # [2, N]
            suppress_mask[index[0], index[1]] = True
        if forbidden is not None:
            suppress_mask = forbidden if suppress_mask is None else suppress_mask | forbidden

        return cls(
            temperature=temperature,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            logit_bias=logit_bias,
            suppress_mask=suppress_mask,
            generators=[None if g else gen for gen, g in zip(generators, greedy, strict=True)],
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs when any row asked (see ``max_num_logprobs``).

    Logprobs are of the *raw* model distribution (``log_softmax`` of the unprocessed logits), not of
    the sampling distribution, as vLLM reports them by default: they show the model's own confidence,
    which the sampling knobs would otherwise distort (a filtered-out alternative would read ``-inf``,
    a greedy row's sampled token ``0``).
    """

    token_ids: torch.Tensor  # [B] int64
    # [B] float32 raw logprob of the sampled token; None if max_num_logprobs < 0
    logprobs: torch.Tensor | None
    top_token_ids: torch.Tensor | None  # [B, K] int64, best first; None unless K = max_num_logprobs > 0
    top_logprobs: torch.Tensor | None  # [B, K] float32 raw logprobs matching top_token_ids


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Penalties, logit bias and suppression (min_tokens, no-repeat n-grams), in that order.

    Returns a new tensor and never modifies ``logits``: the raw logits are still needed for the
    reported logprobs (and, in speculative decoding, by other consumers of the same forward pass).
    Callers on the hot path check :attr:`SamplingMetadata.needs_processing` first to skip the copy.

    * repetition penalty (CTRL style, as HF): a token seen in the prompt or the output has its logit
      divided by the penalty when positive and multiplied by it otherwise, so ``penalty > 1`` always
      makes it less likely;
    * presence / frequency penalty (OpenAI style, output tokens only):
      ``logit -= presence * (count > 0) + frequency * count``;
    * logit bias is added; suppressed tokens become ``-inf``.
    """
    out = logits.clone()  # [B, V]
    if md.repetition_penalty is not None:
        assert md.output_counts is not None and md.presence_penalty is not None
        assert md.frequency_penalty is not None
        counts = md.output_counts  # [B, V]
        in_output = counts > 0  # [B, V]
        seen = in_output if md.prompt_mask is None else in_output | md.prompt_mask  # [B, V]
        penalty = md.repetition_penalty.unsqueeze(1)  # [B, 1]
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
        out -= md.frequency_penalty.unsqueeze(1) * counts
        out -= md.presence_penalty.unsqueeze(1) * in_output
    if md.logit_bias is not None:
        out += md.logit_bias
    if md.suppress_mask is not None:
        out.masked_fill_(md.suppress_mask, float("-inf"))
    return out


def processed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``logits`` after :func:`apply_logits_processors` where any row has a processor, else as they are."""
    return apply_logits_processors(logits, md) if md.needs_processing else logits


def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Raw logits to each row's sampling distribution: :func:`processed`, then :func:`compute_probs`."""
    return compute_probs(processed(logits, md), md)


def compute_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The sampling distribution of each row: ``[B, V]`` float32, each row summing to 1.

    Random rows: ``softmax(logits / T)``, then top-k, then top-p (the smallest set of most likely
    tokens whose probability, renormalised after top-k, reaches ``top_p``; the top token is always
    kept), then min-p (drop tokens below ``min_p`` times the largest probability), renormalised. This
    is vLLM's order: top-k and top-p both see the temperature-scaled distribution.
    Greedy rows: one-hot at the argmax of ``logits`` (ties go to the lowest index, as ``torch.argmax``).

    Speculative rejection sampling uses this exact tensor as the target ``p``; it must therefore be
    the distribution :func:`sample_from_probs` draws from, not an approximation of it.
    """
    if md.all_greedy:
        return _one_hot_argmax(logits)
    temperature = md.temperature  # [B]
    if not md.all_random:
        # Placeholder for greedy rows (their T is 0); their distribution is replaced below.
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)  # [B, V]
    vocab_size = logits.shape[-1]
    filtered = torch.zeros_like(temperature, dtype=torch.bool)  # [B] rows that some filter touched
    if md.top_k is not None or md.top_p is not None:
        probs = _apply_top_k_top_p(probs, md.top_k, md.top_p)
        if md.top_k is not None:
            filtered |= md.top_k < vocab_size
        if md.top_p is not None:
            filtered |= md.top_p < 1.0
    if md.min_p is not None:
        # Renormalisation after top-k/top-p scales every kept token alike, so comparing with the
        # (unchanged) top probability here is the same as comparing on the renormalised distribution.
        threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        filtered |= md.min_p > 0.0
    if md.top_k is not None or md.top_p is not None or md.min_p is not None:
        # Only filtered rows are renormalised: an unfiltered row then gets bit-for-bit the softmax it
        # would get in a batch without filters, so a seeded row's tokens cannot depend on its mates.
        total = probs.sum(dim=-1, keepdim=True)  # [B, 1]
        probs = probs / torch.where(filtered.unsqueeze(1), total, torch.ones_like(total))
    if not md.all_random:
        greedy = (md.temperature == 0).unsqueeze(1)  # [B, 1]
        probs = torch.where(greedy, _one_hot_argmax(logits), probs)
    return probs


def sample_from_probs(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[B, V]``; returns ``[B]`` int64.

    Exponential race, equivalent to Gumbel-max: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. picks
    token ``i`` with probability ``probs[i]``, with no cumulative sum and no host sync. A row with a
    generator draws its ``E`` from that generator alone, one ``[V]`` draw per step, so a seeded row's
    tokens do not depend on its batch mates or its position; the other rows share one batched draw
    from the default RNG. Greedy rows take ``argmax(probs)`` (their one-hot) and consume no
    randomness of their own.
    """
    if md.all_greedy:
        return probs.argmax(dim=-1)
    tokens = (probs / exponential_noise(probs, md.generators)).argmax(dim=-1)  # [B]
    if not md.all_random:
        tokens = torch.where(md.temperature == 0, probs.argmax(dim=-1), tokens)
    return tokens


def exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | NoiseKey | None]) -> torch.Tensor:
    """``[B, V]`` i.i.d. Exp(1) draws (clamped above 0); a row with a generator draws from it alone,
    a row with a :class:`NoiseKey` from the noise of that key.

    ``argmax(probs / E)`` samples a row of ``probs``; the order of ``probs / E``, best first, is a
    sample *without replacement* (the exponential race), which is how sampled draft trees pick
    distinct siblings."""
    seeded = [(row, gen) for row, gen in enumerate(generators) if gen is not None]
    if len(seeded) < probs.shape[0]:
        exp = _exp1(probs.shape, probs.device).to(probs.dtype)  # [B, V]
    else:
        exp = torch.empty_like(probs)
    for row, gen in seeded:
        if isinstance(gen, NoiseKey):
            gen = gen.generator(probs.device)
        exp[row] = _exp1(probs.shape[1:], probs.device, gen)
    return exp.clamp_min_(_TINY)


def _exp1(shape, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """i.i.d. Exp(1) draws as ``-log(U)``, ``U`` uniform in [0, 1) in float64 (53 bits: ``U = 0``, an
    infinite draw, has probability 2^-53). A CPU's ``exponential_`` costs ~15 ns a draw, this under
    6 (docs/benchmarks.md)."""
    return torch.rand(shape, dtype=torch.float64, device=device, generator=generator).log_().neg_()


class Sampler:
    """Raw logits to tokens (and raw-distribution logprobs) for one batch."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]`` float32 (raw model output).

        Logprobs, when requested, are those of the raw model distribution (``log_softmax`` of the
        unprocessed logits), like vLLM's default, whatever temperature, filters or penalties chose
        the token.
        """
        if md.all_greedy and not md.needs_processing:
            tokens = logits.argmax(dim=-1)  # [B] fast path: nothing but an argmax to do
        else:
            shaped = processed(logits, md)
            if md.all_greedy:
                tokens = shaped.argmax(dim=-1)
            else:
                tokens = sample_from_probs(compute_probs(shaped, md), md)
        if md.max_num_logprobs < 0:
            return SamplerOutput(token_ids=tokens, logprobs=None, top_token_ids=None, top_logprobs=None)
        raw = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
        sampled = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
        k = min(md.max_num_logprobs, logits.shape[-1])
        if k == 0:
            return SamplerOutput(token_ids=tokens, logprobs=sampled, top_token_ids=None, top_logprobs=None)
        top_logprobs, top_ids = raw.topk(k, dim=-1)  # [B, K], sorted best first
        return SamplerOutput(token_ids=tokens, logprobs=sampled, top_token_ids=top_ids, top_logprobs=top_logprobs)


# -- helpers -------------------------------------------------------------------------------------


def _penalty_rows(params: Sequence[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """[B] repetition, presence and frequency penalties (neutral values for rows without any).

    A repetition penalty below ``_MIN_REPETITION_PENALTY`` acts as that value, which is already its
    limit: seen tokens' positive logits are scaled by 1e30 (finite in float32 for any real logit, so
    the largest of them takes all the mass, as it does when the penalty tends to 0), negative ones
    fall to about 0. Below it, float32 would divide by 0 and sample from NaNs."""
    rows = [(max(p.repetition_penalty, _MIN_REPETITION_PENALTY), p.presence_penalty, p.frequency_penalty)
            for p in params]  # fmt: skip
    return tuple(to_device(rows, device, torch.float32).unbind(-1))  # one send


def _flat_token_index(rows: list[int], token_ids: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """``row * vocab_size + token`` for every token of the chosen rows, as a host ``[N]`` int64 array.

    Indexing the flattened ``[B * V]`` tensor lets one scatter fill every row at once, without
    padding rows to a common length. ``np.fromiter`` is used because building a tensor from a
    Python list of a million ints is several times slower. Out-of-range ids are dropped so that they
    cannot land in a neighbouring row.
    """
    lengths = np.fromiter((len(token_ids[r]) for r in rows), dtype=np.int64, count=len(rows))
    tokens = np.fromiter(
        itertools.chain.from_iterable(token_ids[r] for r in rows), dtype=np.int64, count=int(lengths.sum())
    )
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    valid = (tokens >= 0) & (tokens < vocab_size)
    return row_ids[valid] * vocab_size + tokens[valid]


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` float32 one-hot at each row's argmax (lowest index on ties)."""
    index = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(1, index, 1.0)


def _apply_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the tokens outside each row's top-k, then outside its top-p nucleus; not renormalised.

    One descending sort serves both filters. A stable sort makes ties at the boundary go to the
    lower token id, so the kept set is deterministic.
    """
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    if top_k is not None:
        rank = torch.arange(probs.shape[-1], device=probs.device)  # [V]
        sorted_probs = sorted_probs.masked_fill(rank.unsqueeze(0) >= top_k.unsqueeze(1), 0.0)
    if top_p is not None:
        sorted_probs = sorted_probs.masked_fill(~_top_p_keep(sorted_probs, top_p), 0.0)
    return torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)


def _top_p_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: which of the descending ``sorted_probs`` lie in the top-p nucleus.

    A token is kept when the mass strictly before it is below ``top_p`` of the row's total (the total
    is below 1 after top-k, which is how top-p sees the renormalised top-k distribution). This keeps
    the smallest prefix whose mass reaches ``top_p``, and always the first token. Rows with
    ``top_p >= 1`` keep everything explicitly: float32 rounding near a cumulative sum of 1 would
    otherwise drop a long tail of tiny probabilities from rows that asked for no filter.
    """
    cumulative = sorted_probs.cumsum(dim=-1)  # [B, V]
    mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # [B, V], exclusive prefix sums
    total = cumulative[:, -1:]  # [B, 1]
    keep = mass_before < top_p.unsqueeze(1) * total
    keep[:, 0] = True  # even when top_p underflows float32 (a top_p of 1e-300 is 0 here)
    return keep | (top_p >= 1.0).unsqueeze(1)
