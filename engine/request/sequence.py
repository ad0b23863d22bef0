"""One object per sequence carries all of its state.

A request with ``n > 1`` is a :class:`SequenceGroup` of ``n`` sequences; only the first is prefilled,
and the others are forked from it (sharing its KV blocks) when its prompt is done: those beyond the
batch's seats wait for one (``Sequence.awaits_seat``, engine/core/scheduler.py).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request.block_table import BlockTable
from engine.request.sampling_params import NoiseKey, SamplingParams
from engine.request.state import AcceptanceEstimate, NgramIndex, SearchState

if TYPE_CHECKING:
    import torch

    from engine.request.detokenizer import IncrementalDetokenizer
    from engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet (or no longer, after preemption) holding KV blocks
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


_seq_ids = itertools.count()


class Sequence:
    """Token ids, KV bookkeeping and decoding state of one generated continuation.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache and final.
    ``block_table`` lists the physical KV blocks that hold them (and any being written this step).
    """

    def __init__(self, group: SequenceGroup, prompt_ids: list[int], index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.group = group
        self.index = index  # position among the group's n choices
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = BlockTable()  # says where it changed (the runner's rows follow)
        self.block_hashes: list[int] = []  # chained hashes of the full, final blocks
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.logprobs: list[TokenLogprob] = []
        self.provenance: list[tuple[str, str | None, int]] = []  # per output token (params.include_speculation)
        self.seed: int | None = None  # this choice's seed (the request's + its index, in 64 bits), if seeded
        self.num_preemptions = 0
        # A beam whose logits row this step is taken, waiting for its group's other beams: nothing to
        # compute until the group's step appends its next token (engine.decoding.beam).
        self.parked = False
        self.search: SearchState | None = None  # contrastive search only
        # Penalty statistics, kept on the device across steps (see engine.core.step): [V] float32
        # output-token counts and [V] bool prompt mask; None until a penalised request first samples.
        self.token_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.ngrams: NgramIndex | None = None  # no_repeat_ngram_size only
        self.grammar: GrammarState | None = None  # structured outputs only: where its grammar stands
        # Speculative decoding state.
        self.draft_num_computed = 0  # leading tokens whose draft-model KV is valid (draft-model proposer)
        # The depth controller's acceptance estimates, per route (the proposer that drafts: one, or
        # each of ``auto``'s), and the route it chose for this step (None: the engine's one proposer).
        self.spec_estimates: dict[str, AcceptanceEstimate] = {}
        self.spec_route: str | None = None
        self.spec_route_age = 0  # plans its route stands before it is chosen anew (0: at the next)
        self.spec_reason: str | None = None  # why the controller's plan gave it no draft this step
        self.spec_idle_steps = 0  # consecutive steps the controller chose not to draft
        self.detok: IncrementalDetokenizer | None = None
        # How much of the output the last RequestOutput already carried (for deltas).
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0

    # -- views -----------------------------------------------------------------------------------
    @property
    def spec_estimate(self) -> AcceptanceEstimate | None:
        """The estimate of its current route (None before the controller made one)."""
        return self.spec_estimates.get(self.spec_route or "")

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def lora_slot(self) -> int:
        return self.group.lora_slot

    @property
    def kv_root(self) -> int:
        return self.group.kv_root

    @property
    def draft_namespace(self) -> tuple[str | None, str | None]:
        """Which requests' text a proposer may draft into this one from: those of the same LoRA adapter
        and tenant (the API key), and no others."""
        return self.group.params.lora, self.group.params.tenant

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def awaits_seat(self) -> bool:
        """A choice forked beyond the seats its request held, waiting for one with its KV in hand (the
        prompt's blocks, shared with its mates): admitted, it decodes at once. (A waiting sequence holds
        no KV otherwise: a preempted one gave it up.)"""
        return self.status is SequenceStatus.WAITING and self.num_computed_tokens > 0

    def noise_key(self, ahead: int = 0) -> NoiseKey | None:
        """The randomness of the output token ``ahead`` places past those emitted (seeded only)."""
        return None if self.seed is None else NoiseKey(self.seed, self.num_output_tokens + ahead)

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens it may still generate, by max_tokens and the context length."""
        left = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - self.num_output_tokens)
        return left

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_candidates(self) -> int:
        """Contrastive search's candidate tokens still to feed for its next token (0: none pending)."""
        return self.params.top_k - self.search.fed if self._choosing else 0

    @property
    def num_candidates_fed(self) -> int:
        """Those of its next token fed in earlier steps: they hold the KV slots after its context."""
        return self.search.fed if self._choosing else 0

    @property
    def _choosing(self) -> bool:
        return self.search is not None and self.search.next_logits is not None and self.num_uncomputed_tokens == 0

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.group.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )


@dataclass
class Hypothesis:
    score: float  # sum of log-probabilities / generated_tokens ** length_penalty
    seq: Sequence  # a finished sequence holding no KV: the beam's tokens, text and finish reason


@dataclass
class BeamState:
    """One beam request's search (``SequenceGroup.beam``); its running beams are ``group.seqs``."""

    scores: list[float] = field(default_factory=lambda: [0.0])  # per running beam, as group.seqs
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # a running beam may still beat the worst kept hypothesis
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id → [V] step scores, until all arrive


class SequenceGroup:
    """A request: its prompt, parameters and the ``n`` sequences generated for it."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.arrival_time = arrival_time
        # The LoRA slot its target forwards run under (-1: the base model), and the parent hash its
        # prefix-cache chain starts from (the adapter's and the cache salt's own: engine/kv/block_manager.py
        # chain_root).
        self.lora_slot = -1
        self.kv_root = 0
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Only the first sequence exists until the prompt is prefilled; the rest are forked from it.
        self.seqs: list[Sequence] = [Sequence(self, prompt_ids, 0)]
        self.error: str | None = None
        # Logprobs of each prompt token given the ones before it (None for the first), when asked for.
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.prompt_logprobs_emitted = False
        self.num_decode_steps = 0  # target forwards that produced tokens, summed over choices
        self.num_draft_tokens = 0  # draft tokens proposed for this request
        self.num_accepted_tokens = 0  # of which the target accepted
        self.drafted_by: dict[str, list[int]] = {}  # proposer → [draft tokens, accepted tokens]
        # Decode steps it was not drafted for, by the reason in a word (see SpecController.plan).
        self.spec_reasons: dict[str, int] = {}
        self.num_forced_tokens = 0  # emitted without a forward: the only tokens its grammar allowed
        # Prompt tokens the prefix cache held when the request was first admitted (None: not yet).
        self.num_cached_prompt_tokens: int | None = None
        self.beam: BeamState | None = None  # a beam-search request's

    @property
    def width(self) -> int:
        """Sequences it runs at once once its prompt is done: n choices, or its beams."""
        return self.params.beam_width

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:  # group.seqs: the running beams, then the chosen hypotheses
            return all(s.is_finished for s in self.seqs)
        # The other choices are forked with the first token, so a first sequence that ended
        # without output (aborted or failed) ends the whole request.
        if not all(s.is_finished for s in self.seqs):
            return False
        return len(self.seqs) == self.params.n or self.seqs[0].num_output_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)
