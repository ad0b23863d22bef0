"""What the engine hands back each step: small dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request.sequence import TokenLogprob


@dataclass
class CompletionOutput:
    """One of a request's ``n`` choices. The ``delta_*`` fields hold what is new since the last output."""

    index: int
    text: str  # everything safe to show so far (a possible stop-string prefix is held back until resolved)
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] | None
    num_tokens: int  # generated tokens so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With SamplingParams.include_speculation: (kind, proposer, depth) of each delta token
    # (engine.sampling.batch.PROVENANCE)
    delta_provenance: list[tuple[str, str | None, int]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStats:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_decode_steps: int = 0  # target forwards that produced this request's tokens (per choice, summed)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_by: dict[str, tuple[int, int]] = field(default_factory=dict)  # proposer → (drafted, accepted)
    spec_reasons: dict[str, int] = field(default_factory=dict)  # decode steps without a draft, by reason
    num_forced_tokens: int = 0  # emitted by jump-forward: the only tokens the request's grammar allowed
    grammar_seconds: float = 0.0  # host time in the request's grammar (masks, advancing, forcing)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: RequestStats
    error: str | None = None  # set when this request failed inside the engine (finish_reason "error")
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, in the first output after the prefill
    extra: dict = field(default_factory=dict)
