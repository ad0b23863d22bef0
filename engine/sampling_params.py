"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    speculative: bool | None = None  # False: never draft for this request; None: the engine decides
    num_draft_tokens: int | None = None  # fixed draft depth for this request (None: tuned per step)
    # LOSSY, opt-in: Medusa's typical acceptance, (epsilon, delta). A draft token x is accepted where the
    # target's p(x) > min(epsilon, delta * exp(-H(p))), so the output is no longer exactly the target's
    # distribution (None: lossless verification, the default).
    typical_acceptance: tuple[float, float] | None = None

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
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                check(-100.0 <= bias <= 100.0, f"logit_bias for token {tok} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
