"""Self-speculative decoding by layer skipping (``--speculative-method layer-skip``).

The draft is the target itself with some attention and MLP sublayers left out (a
:class:`~engine.models.layer_skip.LayerSkip`, from ``--layer-skip-config`` or the untuned default):
no second model, no extra weights, no cache of its own. It reads the target's KV of the context and
writes draft-time K/V (of the sublayers it runs) only into the slots of the root and the draft
nodes, which the verify forward then overwrites with the full model's. Each step is one root
forward (the sequence's last token, which the target has not cached yet) and one forward per
further level; chains, greedy trees and sampled trees are drawn exactly as the draft-model method
draws them (this class reuses its drafting, with the target in place of the draft model).

A draft level here costs a large part of a target forward, so a draft the drafter is unsure of is
cut short by default (``engine/speculative/early_stop.py``, Draft & Verify's adaptive confidence
exit, aiming at ``EARLY_STOP_TARGET`` of the drafted tokens accepted; ``--spec-early-stop``).
"""

from __future__ import annotations

import torch

from engine.models.layer_skip import LayerSkip
from engine.request.sequence import Sequence
from engine.runner.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.sampling.tree import DraftTree
from engine.speculative.early_stop import EarlyStop, early_stop_for
from engine.speculative.methods.draft_model import DraftModelProposer
from engine.speculative.proposer import CostShape

EARLY_STOP_TARGET = 0.7  # the acceptance rate of drafted tokens the confidence threshold aims at


class LayerSkipProposer(DraftModelProposer):
    method = "layer-skip"
    cost = CostShape(kind="layer-skip")  # a root forward (like a catch-up), then one per level
    # Its levels run on the target's frozen graphs; a chain graph would freeze a second weight copy.
    fuses_chains = False
    # Its drafts come from the target itself, not from a language model of its own: contrastive
    # decoding has no amateur here and refuses (docs/decoding.md).
    has_language_model = False

    def __init__(
        self,
        target: ModelRunner,
        skip: LayerSkip,
        eos_token_ids: list[int],
        tree: bool,
        topk: int,
        budget: int,
        early_stop: EarlyStop | None = None,
    ) -> None:
        super().__init__(target, target.vocab_size, eos_token_ids, tree, topk, budget, early_stop=early_stop)
        self.skip = skip.check(target.model.num_layers)
        self.kv_bytes_per_token = 0  # it drafts in the target's own cache

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> LayerSkipProposer:
        layers = target.model.num_layers
        skip = LayerSkip.load(config.layer_skip_config) if config.layer_skip_config else LayerSkip.middle(layers)
        tree, stop = config.spec_tree_topk > 1, early_stop_for(config, default=EARLY_STOP_TARGET)
        return cls(target, skip, eos_token_ids, tree, config.spec_tree_topk, config.spec_tree_budget, stop)

    # The target owns the cache: nothing to allocate, copy or keep valid across steps.
    def allocate_kv(self, num_blocks: int) -> None:
        pass

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        self.observe_acceptance(seq, tree, accepted)
        self._written.pop(seq.seq_id, None)

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        pass

    def warmup(self) -> None:
        self.runner.capture_graphs(skip=self.skip)

    def warm_compiled(self, view) -> None:
        view(self.runner).warm_compiled(skip=self.skip)

    def cost_probe(self):
        return lambda chunks: self.runner.forward(chunks, skip=self.skip)

    def _root_logits(self, seqs: list[Sequence], ctx) -> tuple[list[int], torch.Tensor, None]:
        """Every sequence is ready: its context is in the target's cache; feed its root token."""
        chunks = [ForwardChunk([s.token_ids[-1]], s.num_tokens - 1, s.block_table, 1, lora=s.lora_slot) for s in seqs]
        return list(range(len(seqs))), *self._forward(self.runner.prepare(chunks), chunks)

    def _forward(self, batch: ForwardBatch, chunks: list[ForwardChunk], input_ids=None, hidden_in=None):
        self.num_forwards += 1
        lap = self.runner.lap()
        logits = self.runner.execute(batch, input_ids=input_ids, skip=self.skip).logits
        self._timings.append((self.cost.kind, batch.num_seqs, batch.num_tokens, lap.stop(), 1))
        return logits, None
