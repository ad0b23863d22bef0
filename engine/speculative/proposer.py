"""The one interface every drafting method implements (the registry that builds them by name is
``engine/speculative/methods/__init__.py``).

Every proposer gets the same inputs — the sequences to draft for, each one's draft depth, and a
:class:`ProposeContext` with what the target's forwards produced for them (hidden states of the
layers the proposer asked for) — and returns the same output: one :class:`DraftTree` per sequence
(a chain is a tree). The speculative step (``engine/core/step.py``) never branches on the
method; what differs between methods lives behind these hooks:

- ``build(config, target, ...)``: the registry's constructor; a method loads what it needs (a draft
  model, heads, nothing at all) and may reuse the target runner (layer skipping, heads on the
  target's LM head).
- ``kv_bytes_per_token`` / ``allocate_kv(num_blocks)``: a proposer with its own KV cache is sized
  into the one pool (its cache is indexed by the target's block tables, one slot per target slot).
- ``hidden_layers``: target layers whose hidden states are captured in every prefill and verify
  forward and handed over (:meth:`Proposer.on_computed`, and ``ProposeContext.hidden_states``).
- ``cost``: the shape of the proposer's own cost (:class:`CostShape`), so the one controller tunes
  every method: a draft model's forwards, or nothing for a lookup.
- rows of its own in the target's forward (:meth:`Proposer.extra_rows`): tokens at positions past the
  root, attending to the context, the root and each other, never to the tree (nor the tree to them),
  whose KV slots come after the tree's and are released after the step; their logits come back in
  one call (:meth:`Proposer.on_verify_logits`). Lookahead decoding's Jacobi window rides there.
- the verify forward's logits over its tree's rows, for a method that learns from what the target
  said there (``reads_verify_logits``, the same call): Ouroboros's phrase pool.
- lifecycle: ``on_computed`` (tokens whose target KV became final, with their hidden states),
  ``on_verified`` (which nodes of its tree the target kept), ``on_fork``, ``on_preempt``,
  ``on_free``, ``copy_blocks`` (copy-on-write in its own cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.request.sequence import Sequence
from engine.sampling.tree import DraftTree

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runner.model_runner import ForwardChunk, ModelRunner


@dataclass(frozen=True)
class CostShape:
    """How a proposer spends time, in terms the controller's cost model measures.

    ``kind`` names the cost-model table its forwards are timed in (``None``: drafting costs no model
    time, e.g. a lookup). A model-based proposer runs one *catch-up* forward per step over what it
    has not seen (the root and the tokens accepted last step), then one forward per further draft
    level over that level's nodes.
    """

    kind: str | None = None
    catch_up: bool = True
    per_level: bool = True


@dataclass
class ProposeContext:
    # seq_id → {layer: [n, hidden]} target hidden states of the tokens that became final in the
    # sequence's last target forward (the rows handed to on_computed), for proposers that read them
    hidden_states: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ExtraRows:
    """Rows a proposer adds to a sequence's verify forward, after its tree's rows. Each row sees the
    cached context, the root and the rows ``mask`` allows; never a tree node, and no tree node sees it."""

    tokens: list[int]  # [m]
    offsets: list[int]  # [m] each row's position minus the root's (>= 1)
    mask: torch.Tensor  # [m, m] bool: row r attends to row c (r attends to itself)

    def __len__(self) -> int:
        return len(self.tokens)

    def beside(self, tree_mask: torch.Tensor | None, tree_rows: int) -> torch.Tensor:
        """The forward's mask over ``[root, tree nodes…, these rows]``, from the tree's (None: a chain)."""
        q = tree_rows + len(self.tokens)
        mask = torch.zeros(q, q, dtype=torch.bool)
        causal = torch.ones(tree_rows, tree_rows, dtype=torch.bool).tril()
        mask[:tree_rows, :tree_rows] = causal if tree_mask is None else tree_mask
        mask[tree_rows:, 0] = True
        mask[tree_rows:, tree_rows:] = self.mask
        return mask


@dataclass
class VerifyRows:
    """One sequence's rows in a verify forward, after acceptance: the root's row ``row``, its tree's
    nodes at ``row + 1 + i``, then its extra rows (if any)."""

    seq: Sequence
    tree: DraftTree  # the tree the forward verified (what a grammar left of the draft)
    accepted: list[int]  # the nodes kept, root to leaf
    emitted: list[int]  # the tokens the step emitted: the kept nodes' and the one sampled after them
    row: int
    extra: ExtraRows | None = None

    @property
    def extra_row(self) -> int:
        return self.row + 1 + len(self.tree)


class Proposer(ABC):
    """Base class: a method must say how to build it, what a draft costs in KV slots and how to
    draft; the other hooks do nothing by default, so it overrides only what it needs."""

    method: ClassVar[str] = ""  # the registry key and the metrics label
    cost: ClassVar[CostShape] = CostShape()
    hidden_layers: tuple[int, ...] = ()  # target layers to capture (the last is num_layers - 1)
    kv_bytes_per_token: int = 0  # bytes of its own KV per pool slot (0: none)
    # It runs a language model of its own over the sequence: contrastive decoding's amateur, through
    # :meth:`next_token_logits`.
    has_language_model: ClassVar[bool] = False
    # It hears the target's logits over its trees' rows (:meth:`on_verify_logits`), not only its extra rows'.
    reads_verify_logits: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def build(cls, config: EngineConfig, target: ModelRunner, *, tokenizer, eos_token_ids: list[int]) -> Proposer:
        """Load what the method needs; ``target`` is the target's runner (its model, vocabulary, device)."""

    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:  # [len(seqs), V]
        """Its own model's logits for each sequence's next token, every token of it fed (contrastive
        decoding's amateur). Only a proposer with ``has_language_model`` has them; the engine refuses
        contrastive requests elsewhere, so reaching this is a bug."""
        raise TypeError(f"the {self.method} proposer has no language model of its own")

    @classmethod
    def claims(cls, path: Path) -> bool:
        """Whether a ``--draft-model`` directory is this method's (its layout says so), so that
        ``--draft-model DIR`` alone picks the method. The draft-model method is the fallback."""
        return False

    # -- shape and drafting ---------------------------------------------------------------------
    @abstractmethod
    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        """KV slots past the root a draft of this depth may take (verify nodes and draft-side
        writes), for a greedy or a sampling request (a method may draft them in different shapes)."""

    def deepest(self, configured: int) -> int:
        """The deepest draft it makes when ``configured`` is asked for (the controller plans no deeper)."""
        return configured

    def depth_for_slots(self, slots: int, depth: int, greedy: bool, route: str | None = None) -> int:
        """The deepest draft no deeper than ``depth`` that fits in ``slots`` granted KV slots."""
        while depth > 0 and self.slots_for(route, depth, greedy) > slots:
            depth -= 1
        return depth

    # -- several proposers in one (``auto``): a *route* names the one that drafts a sequence --------
    def routes(self) -> tuple[str, ...]:
        """The proposers a sequence's draft may come from, one chosen per sequence and step by the
        controller (``Sequence.spec_route``); a single method is its own one route."""
        return (self.method,)

    def choices(self) -> tuple[str, ...]:
        """The routes the controller chooses among for a request that pins none (the rest of
        :meth:`routes` serve pinned requests only)."""
        return self.routes()

    def cost_for(self, route: str | None) -> CostShape:
        """The cost shape of drafting by ``route`` (None: the proposer's own)."""
        return self.cost

    def slots_for(self, route: str | None, depth: int, greedy: bool = True) -> int:
        """:meth:`slots_needed` of a draft by ``route`` (None: the proposer's own)."""
        return self.slots_needed(depth, greedy)

    def catch_up_tokens(self, seq: Sequence, route: str | None = None) -> int:
        """Tokens its catch-up forward would feed for ``seq`` before drafting (by ``route``): the root
        and last step's accepted tokens in a steady run; everything since it last drafted for a model
        drafter that sat some steps out (the price of switching a request to it)."""
        return 2

    def cost_kinds(self) -> tuple[str, ...]:
        """The cost-model kinds its forwards are timed in (none for a lookup)."""
        return (self.cost.kind,) if self.cost.kind else ()

    def cost_probes(self) -> list[tuple[Callable[[list[ForwardChunk]], object], str]]:
        """(:meth:`cost_probe`, its kind) for each kind of forward it runs."""
        probe = self.cost_probe() if self.cost.kind else None
        return [(probe, self.cost.kind)] if probe is not None else []

    @abstractmethod
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        """Draft a tree of at most ``depths[i]`` levels for each sequence (its last token is the root)."""

    def extra_rows(self, seq: Sequence, tree: DraftTree, slots: int) -> ExtraRows | None:
        """Rows of its own for ``seq``'s verify forward beside ``tree`` (already cut by any grammar),
        in at most ``slots`` KV slots, at offsets past the root of at most ``slots``
        (both stay within the context); None: none. Asked of every drafting sequence, even when its
        tree is empty; their slots must be counted in :meth:`slots_needed`."""
        return None

    def on_verify_logits(self, rows: list[VerifyRows], logits: torch.Tensor) -> None:  # noqa: B027
        """Once a step, after acceptance, with the forward's raw ``logits``: the rows of each sequence
        given extra rows and, with ``reads_verify_logits``, of each sequence that drafted a tree."""

    def timings(self) -> list[tuple[str, int, int, float]]:
        """(cost kind, sequences, tokens, seconds) of the proposer's forwards since the last call."""
        return []

    def cost_probe(self) -> Callable[[list[ForwardChunk]], object] | None:
        """A function running one of the proposer's forwards over these chunks, which the engine times
        at start-up (sequences x tokens) to seed the controller's cost model; None: nothing to time."""
        return None

    # Every hook below is deliberately a no-op unless a method overrides it (hence the B027 waivers).
    def warmup(self) -> None:  # noqa: B027
        """One-off work before the first request (capturing the proposer's CUDA graphs)."""

    def runners(self) -> list[ModelRunner]:
        """The model runners whose forwards the proposer runs (its own, or the target's)."""
        return []

    def warm_compiled(self, view: Callable[[ModelRunner], ModelRunner]) -> None:  # noqa: B027
        """Run each of the proposer's compiled forwards once, as the step calls them, through
        ``view(runner)`` for each of :meth:`runners` (the runner itself, or a
        :meth:`~engine.runner.model_runner.ModelRunner.compile_view` of it in the background)."""

    def warm_chains(self, view: Callable[[ModelRunner], ModelRunner]) -> bool:
        """Compile the graphs that run several draft levels in one call, as :meth:`warm_compiled` (a
        background compile swaps the compiled forwards in before these: until a chain length's graph
        is ready, its levels run one compiled forward each); whether there were any."""
        return False

    # -- its own cache --------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:  # noqa: B027
        """Allocate the proposer's KV cache for a pool of ``num_blocks`` (only if kv_bytes_per_token)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:  # noqa: B027
        """Mirror the target cache's copy-on-write block copies in the proposer's own cache."""

    # -- lifecycle ------------------------------------------------------------------------------
    def on_computed(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:  # noqa: B027
        """Target KV of ``seq`` tokens ``start .. start + n`` became final in the last forward;
        ``hidden[layer]`` is ``[n, hidden]`` for each layer in ``hidden_layers`` (empty otherwise)."""

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:  # noqa: B027
        """Verification kept the nodes ``accepted`` (node indices, root to leaf) of the sequence's tree."""

    def on_fork(self, parent: Sequence, child: Sequence) -> None:  # noqa: B027
        """``child`` was forked off ``parent`` (n > 1): it shares the parent's blocks so far."""

    def on_preempt(self, seq: Sequence) -> None:  # noqa: B027
        """``seq`` lost its KV blocks; everything it had computed will be recomputed."""

    def on_free(self, seq: Sequence) -> None:  # noqa: B027
        """``seq`` finished or was aborted."""

    def forget_adapter(self, name: str) -> None:  # noqa: B027
        """Drop what was kept from LoRA adapter ``name``'s requests (their outputs, to draft from): it was
        unloaded, or a new adapter is loading under its name."""
