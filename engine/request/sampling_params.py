"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request.structured import StructuredOutput

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable
    those filters. ``repetition_penalty`` (multiplicative, CTRL style) applies to prompt and output
    tokens; ``presence_penalty`` and ``frequency_penalty`` (additive, OpenAI style) to output tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    no_repeat_ngram_size: int = 0  # > 0: never complete an n-gram of this size that prompt + output already hold
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    prompt_logprobs: int | None = None  # logprobs (with top alternatives) of the prompt's own tokens
    skip_special_tokens: bool = True
    # Special tokens decoded into the text even where skip_special_tokens leaves the others out: markup a
    # server parser reads (Mistral's [TOOL_CALLS] and [ARGS], which its tokenizers make special tokens).
    kept_special_ids: tuple[int, ...] = ()
    lora: str | None = None  # the LoRA adapter it runs under, by name (EngineConfig.lora_modules); None: the base model
    # Whose requests may lend it drafting data (the server sets its API key's digest): proposers that
    # learn from other requests' text (suffix decoding's store, lookahead's shared pools) keep one
    # store per (lora, tenant), so no adapter's or key's text is ever drafted into another's requests.
    tenant: str | None = None
    # vLLM's cache_salt: the prefix cache shares KV only among requests with the same salt (and adapter),
    # so a tenant's prompts cannot be probed through another's cache hits. None: shared with every
    # request that has none.
    cache_salt: str | None = None
    # Each output token's provenance in CompletionOutput.delta_provenance (drafted and accepted, bonus,
    # recovered, forced, plain; its proposer and the draft depth): the stream's include_speculation
    include_speculation: bool = False
    speculative: bool | None = None  # False: never draft for this request; None: the engine decides
    num_draft_tokens: int | None = None  # fixed draft depth for this request (None: tuned per step)
    # The proposer that drafts for this request, one the engine holds (None: the controller chooses
    # per step among them; see ``--speculative-method auto``).
    speculative_method: str | None = None
    # LOSSY, opt-in: Medusa's typical acceptance, (epsilon, delta). A draft token x is accepted where the
    # target's p(x) > min(epsilon, delta * exp(-H(p))), so the output is no longer exactly the target's
    # distribution (None: lossless verification, the default).
    typical_acceptance: tuple[float, float] | None = None
    # Beam search (engine.decoding.beam): best_of beams (default n), the n best returned; deterministic,
    # so temperature is not used; never speculated.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0  # hypothesis score = sum of logprobs / generated_tokens ** length_penalty
    early_stopping: bool | str = False  # True, False or "never" (transformers' meanings)
    # Contrastive decoding (engine.decoding.contrastive), (alpha, beta): the expert's (target's) and the
    # amateur's (draft model's) log-probabilities combined as (1 + beta) * expert - beta * amateur over
    # the tokens whose expert probability is at least alpha times the top one; never speculated.
    contrastive: tuple[float, float] | None = None
    # Contrastive search (engine.decoding.contrastive_search): > 0 picks among the top_k candidates by
    # (1 - penalty_alpha) * probability - penalty_alpha * degeneration penalty; deterministic, unspeculated.
    penalty_alpha: float = 0.0
    # Structured outputs: the output must match this JSON schema, regex, choice or grammar; every row the
    # request samples or verifies is masked by it (engine/structured), speculation stays exact.
    structured: StructuredOutput | None = None
    # ... and a structure that max_tokens (or the context) would cut is closed within it instead: the
    # one place where the budget shapes the text (engine/structured/closing.py).
    close_at_max_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(self.n >= 1, f"n must be at least 1, got {self.n}")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(self.top_k >= 0 or self.top_k == -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.seed is None or -(2**63) <= self.seed < 2**64,
            f"seed must be a 64-bit integer (in [-2^63, 2^64)), got {self.seed}",
        )
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(
            self.no_repeat_ngram_size >= 0,
            f"no_repeat_ngram_size must be non-negative, got {self.no_repeat_ngram_size}",
        )
        check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
        )
        check(
            self.num_draft_tokens is None or self.num_draft_tokens >= 0,
            f"num_draft_tokens must be non-negative, got {self.num_draft_tokens}",
        )
        if self.typical_acceptance is not None:
            eps, delta = self.typical_acceptance
            check(0.0 < eps <= 1.0 and delta > 0.0, "typical acceptance needs 0 < epsilon <= 1 and delta > 0")
            check(not self.greedy, "typical acceptance applies to sampling (temperature > 0); greedy is exact")
            check(
                self.seed is None,
                "typical acceptance is lossy: a seeded request's promise (the same text with speculation on or "
                "off) cannot hold",
            )
        if self.contrastive is not None:
            alpha, beta = self.contrastive
            check(0.0 < alpha <= 1.0, f"contrastive alpha must be in (0, 1], got {alpha}")
            check(0.0 <= beta <= 10.0, f"contrastive beta must be in [0, 10], got {beta}")
            check(not self.use_beam_search, "contrastive decoding and beam search do not combine")
            check(self.typical_acceptance is None, "contrastive decoding is never speculated: no typical acceptance")
            self.speculative = False
        if self.penalty_alpha:
            self._validate_search(check)
        if self.use_beam_search:
            self._validate_beam(check)
        else:
            check(self.best_of is None or self.best_of == self.n, "best_of other than n needs use_beam_search")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                check(-100.0 <= bias <= 100.0, f"logit_bias for token {tok} must be in [-100, 100], got {bias}")

    def _validate_beam(self, check) -> None:
        check(self.best_of is None or self.best_of >= 1, f"best_of must be at least 1, got {self.best_of}")
        check(self.n <= self.beam_width, f"n ({self.n}) must not exceed the number of beams, best_of ({self.best_of})")
        check(self.early_stopping in (True, False, "never"), 'early_stopping must be true, false or "never"')
        check(abs(self.length_penalty) <= 100.0, f"length_penalty must be in [-100, 100], got {self.length_penalty}")
        sampling = [
            ("top_p", self.top_p != 1.0),
            ("top_k", self.top_k not in (0, -1)),
            ("min_p", self.min_p != 0.0),
            ("seed", self.seed is not None),
            ("typical_acceptance", self.typical_acceptance is not None),
            ("num_draft_tokens", bool(self.num_draft_tokens)),
        ]
        for name, used in sampling:
            check(not used, f"{name} does not apply to beam search (it ranks beams by log-probability, draws nothing)")
        check(self.logprobs is None, "logprobs are not reported for beam search")
        if self.beam_width == 1:  # one beam is greedy decoding, as transformers' num_beams=1 is
            self.use_beam_search, self.temperature = False, 0.0
            return
        self.speculative = False

    def _validate_search(self, check) -> None:
        check(0.0 < self.penalty_alpha <= 1.0, f"penalty_alpha must be in [0, 1], got {self.penalty_alpha}")
        check(self.top_k >= 2, f"contrastive search chooses among top_k >= 2 candidates, got top_k {self.top_k}")
        check(self.n == 1, "contrastive search is deterministic: n > 1 would repeat one answer")
        check(not self.use_beam_search and self.contrastive is None, "contrastive search combines with no other search")
        unused = [("top_p", self.top_p != 1.0), ("min_p", self.min_p != 0.0), ("seed", self.seed is not None)]
        unused += [("typical_acceptance", self.typical_acceptance is not None), ("logprobs", self.logprobs is not None)]
        for name, used in unused:
            check(not used, f"{name} does not apply to contrastive search")
        self.speculative = False

    @property
    def contrastive_search(self) -> bool:
        return self.penalty_alpha > 0.0

    @property
    def beam_width(self) -> int:
        """Beams a beam-search request keeps (best_of, default n); n for any other request."""
        return (self.best_of or self.n) if self.use_beam_search else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class NoiseKey:
    """The randomness of one seeded output position: the noise drawn for it depends on the request's
    seed and the position alone (never on batch mates, on how many tokens a step emitted, or on
    what was drafted), which is what makes a seeded request's output a function of its seed."""

    seed: int  # the choice's seed, in [0, 2^64)
    position: int  # index of the output token being sampled

    def generator(self, device: torch.device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(_mix64(self.seed, self.position))
        return g


_MASK64 = (1 << 64) - 1


def _mix64(seed: int, position: int) -> int:
    """SplitMix64's finaliser over (seed, position): nearby keys give unrelated generator seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
