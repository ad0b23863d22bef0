"""Whether a request can be served as asked, checked once before it enters the engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """The request itself is wrong (the server answers 400, naming ``param`` when it is known)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_capacity: int,  # token slots of the KV pool (blocks x block size); at least max_model_len
    has_amateur: bool,  # a draft model serves that contrastive decoding can use as its amateur
) -> None:
    """Raise InvalidRequestError if this request cannot be served as asked (its parameters alone were
    checked when they were made: :meth:`SamplingParams.validate`), or could never be served by this
    engine, however long it waited: it is refused here, before it is queued.

    What a request needs at worst, by strategy: one sequence (sampling, greedy, speculation) holds at
    most ``max_model_len`` tokens of KV, which the pool always holds, and drafts take only the
    lookahead the scheduler can spare; ``n`` choices and beams run side by side when they fit and
    are preempted and recomputed when they do not, so they need seats, not ``n`` contexts of KV:
    choices beyond ``max_num_seqs`` wait for a seat (any ``n`` is served), but beams step in
    lockstep, so all of them need a seat in one batch; contrastive search feeds its ``top_k``
    candidates in one step, past the context: ``prompt + max_tokens + top_k - 1`` slots and
    ``top_k`` tokens of the step's budget."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt must not be empty")
    if params.use_beam_search and params.beam_width > max_num_seqs:
        raise InvalidRequestError(
            f"{params.beam_width} beams exceed the {max_num_seqs} sequences one batch can hold (--max-num-seqs): "
            "beams step together",
            "best_of" if params.best_of is not None else "n",
        )
    if params.contrastive is not None and not has_amateur:
        raise InvalidRequestError(
            "contrastive decoding needs a draft model as its amateur: serve with --draft-model "
            "(speculative method 'draft')",
            "contrastive",
        )
    if params.contrastive_search and params.top_k > min(vocab_size, max_num_batched_tokens):
        raise InvalidRequestError(
            f"top_k ({params.top_k}) exceeds the vocabulary ({vocab_size}) or the tokens one step feeds "
            f"({max_num_batched_tokens}, --max-num-batched-tokens): contrastive search feeds its candidates at once",
            "top_k",
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids out of range [0, {vocab_size}): {bad[:5]}", "logit_bias")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context length is {max_model_len}"
        )
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"length of {max_model_len} tokens"
        )
    if params.contrastive_search:
        new_tokens = params.max_tokens if params.max_tokens is not None else room
        need = len(prompt_ids) + new_tokens + params.top_k - 1
        if need > kv_capacity:
            fits = kv_capacity - len(prompt_ids) - params.top_k + 1
            hint = f"max_tokens at most {fits}" if fits >= 1 else "a smaller top_k or a shorter prompt"
            raise InvalidRequestError(
                f"contrastive search writes its top_k ({params.top_k}) candidates past the context: prompt "
                f"({len(prompt_ids)} tokens) + max_tokens ({new_tokens}) + top_k - 1 = {need} KV slots, more "
                f"than the server's KV cache holds ({kv_capacity} tokens); ask for {hint}"
            )


@dataclass(frozen=True)
class RequestLimits:
    """What :func:`check_request` checks a request against: an engine's fixed limits, which a front in
    another process receives once, when the engine is ready (``engine/core/engine_core.py``)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity: int
    has_amateur: bool
    spec_methods: tuple[str, ...] = ()  # the proposers a request may pin (``speculative.method``)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        pinned = params.speculative_method
        if pinned is not None and pinned not in self.spec_methods:
            held = f"it drafts with {', '.join(self.spec_methods)}" if self.spec_methods else "it does not speculate"
            raise InvalidRequestError(f"speculative.method {pinned!r} is not served here: {held}", "speculative.method")
        check_request(
            prompt_ids, params, self.vocab_size, self.max_model_len, self.max_num_seqs,
            self.max_num_batched_tokens, self.kv_capacity, self.has_amateur,
        )  # fmt: skip


class TextFit:
    """Refuses, before it is tokenized, a text too long for the context whatever its tokens: no token
    decodes to more characters than its vocabulary entry has (byte-level, SentencePiece and added
    tokens alike), so a text needs at least ``len(text) / that many`` tokens."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._max_token_chars: int | None = None

    def check(self, text: str) -> None:
        if len(text) <= self.max_model_len:
            return
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        if len(text) > self.max_model_len * self._max_token_chars:
            raise InvalidRequestError(
                f"the prompt ({len(text)} characters) cannot fit the context of {self.max_model_len} tokens"
            )
