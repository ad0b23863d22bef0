"""Drafting with a separate small model that shares the target's tokenizer.

The draft keeps its own KV cache beside the target's (``engine/speculative/own_cache.py``: the same
block tables, ``Sequence.draft_num_computed``, prefix reuse by the target's block hashes). Each step
first *catches up* (feeds the draft what it has not seen, up to the root; long catch-ups, e.g. a new
prompt, are chunked under the step's token budget and draft nothing until done), then drafts chains
or trees level by level (``engine/speculative/levels.py``): each level's tokens stay on the device and
feed the next forward, whose metadata the host prepared in advance.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models import model_class_for
from engine.models.packed import MIN_PACKED_BYTES
from engine.models.small_linear import small_rows_serve
from engine.request.sequence import Sequence
from engine.runner.loader import load_config, load_model, load_tokenizer, resolve_model_path
from engine.runner.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.sampling.tree import DraftTree
from engine.speculative.early_stop import EarlyStop, early_stop_for
from engine.speculative.levels import LevelDrafter
from engine.speculative.own_cache import OwnCache
from engine.speculative.proposer import CostShape, ProposeContext


class DraftModelProposer(LevelDrafter):
    method = "draft"
    has_language_model = True
    cost = CostShape(kind="draft")
    # Draft row r holds the sequence's token r + shift at position r (EAGLE: 1, its row r pairs the
    # target's hidden state at position r with the token that followed it).
    shift: int = 0
    state_layers: tuple[int, ...] = ()  # the draft layer whose output is the next level's state
    fuses_chains = True  # chains' levels in one call (see LevelDrafter._fused_chains)

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        eos_token_ids: list[int],
        tree: bool,
        topk: int = 2,
        budget: int = 16,
        catch_up_budget: int = 2048,
        early_stop: EarlyStop | None = None,
        max_depth: int = 0,  # the deepest draft a step asks for (its greedy chains are compiled ahead)
    ) -> None:
        super().__init__(target_vocab_size, eos_token_ids, runner.device, tree, topk, budget, early_stop)
        self.runner = runner
        self.max_depth = max_depth
        # The draft may pad its vocabulary differently from the target: its distributions are
        # widened to the target's (padding ids get no mass), and ids it has no row for are never fed.
        self.draft_vocab_size = runner.vocab_size
        # Sampled chains in one call draw from the draft's own logits: only where they are the target's width.
        self.fuses_sampled_chains = self.draft_vocab_size == target_vocab_size
        self.catch_up_budget = catch_up_budget
        self.kv_bytes_per_token = runner.kv_bytes_per_token
        self.num_forwards = 0
        self.cache = OwnCache(runner, self.shift)

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids: list[int]) -> DraftModelProposer:
        runner = load_draft_runner(config, target, tokenizer, cls.method)
        tree = config.spec_tree_topk > 1
        budget, catch_up = config.spec_tree_budget, config.max_num_batched_tokens
        stop = early_stop_for(config, default=None)
        depth = config.num_speculative_tokens
        return cls(runner, target.vocab_size, eos_token_ids, tree, config.spec_tree_topk, budget, catch_up, stop, depth)

    # -- cache and lifecycle --------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        self.cache.allocate(num_blocks)

    def warmup(self) -> None:
        self.runner.capture_graphs()

    def runners(self) -> list[ModelRunner]:
        return [self.runner]

    @property
    def runs_chains(self) -> bool:
        """Its drafts are chains of levels fused in one call (not trees): what its chain graphs serve."""
        return self.fuses_chains and not self.tree

    def warm_compiled(self, view) -> None:
        view(self.runner).warm_compiled(chains=self.runs_chains)

    def warm_chains(self, view) -> bool:
        if not self.runs_chains:
            return False
        return view(self.runner).warm_chains(max(self.max_depth - 1, 0), self.fuses_sampled_chains)

    def cost_probe(self):
        return self.runner.forward

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.cache.copy_blocks(copies)

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        # The root's draft KV is in place (catch-up wrote it). Nodes the draft fed at their final slot
        # (a chain's, a sampled tree's spine, a greedy tree's best first child) stay valid while the
        # accepted path follows them; anything else is recomputed by the next catch-up.
        self.observe_acceptance(seq, tree, accepted)
        written = self._written.pop(seq.seq_id, [])
        keep = 0
        while keep < min(len(accepted), len(written)) and accepted[keep] == written[keep]:
            keep += 1
        seq.draft_num_computed += keep

    def catch_up_tokens(self, seq: Sequence, route: str | None = None) -> int:
        return max(seq.num_tokens - seq.draft_num_computed, 1)

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        child.draft_num_computed = parent.draft_num_computed

    def on_preempt(self, seq: Sequence) -> None:
        seq.draft_num_computed = 0
        self._written.pop(seq.seq_id, None)
        self.cache.forget(seq)

    def on_free(self, seq: Sequence) -> None:
        super().on_free(seq)
        self.cache.forget(seq)

    # -- drafting -------------------------------------------------------------------------------
    def _root_logits(self, seqs: list[Sequence], ctx: ProposeContext, after_root: list[list[int]] | None = None):
        """Catch up (feed the draft what it has not seen, chunked under the budget): the indices of
        the sequences whose root was reached, the draft's logits there ``[len(ready), V]`` and their
        states (see :meth:`_forward`). With ``after_root``, a sequence that reaches its root also feeds
        those tokens after it (draft slots ``root + 1 …``, not counted as computed) and gets a logits
        row for each: ``1 + len(after_root[i])`` rows per ready sequence, in order."""
        ready, chunks, states, budget = [], [], [], self.catch_up_budget
        for i, s in enumerate(seqs):
            self._skip_cached_prefix(s)
            start = s.draft_num_computed
            n = s.num_tokens - self.shift - start
            take = min(n, max(budget, 1))
            budget -= take
            tokens = s.token_ids[start + self.shift : start + self.shift + take]
            more = after_root[i] if after_root is not None and take == n else []
            budget -= len(more)
            chunks.append(
                ForwardChunk(tokens + more, start, s.block_table, (1 + len(more)) * int(take == n), lora=s.lora_slot)
            )
            states.append(self._catch_up_state(s, start, take))
            if take == n:
                ready.append(i)
        hidden_in = torch.cat(states) if states[0] is not None else None
        logits, state = self._forward(self.runner.prepare(chunks), chunks, hidden_in=hidden_in)
        for s, c in zip(seqs, chunks):
            s.draft_num_computed = min(s.draft_num_computed + len(c.token_ids), s.num_tokens - self.shift)
            self.cache.mark_valid(s)
        return ready, logits, state

    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Catch each sequence up in full (in budget-sized forwards) and return the draft's logits for
        its next token ``[len(seqs), V]``."""
        rows: list[torch.Tensor | None] = [None] * len(seqs)
        todo = list(range(len(seqs)))
        while todo:
            ready, logits, _ = self._root_logits([seqs[i] for i in todo], ProposeContext())
            for r, row in zip(ready, logits):
                rows[todo[r]] = row
            todo = [i for i in todo if rows[i] is None]
        return torch.stack(rows)

    def _catch_up_state(self, seq: Sequence, start: int, n: int) -> torch.Tensor | None:
        """The per-row input besides the token for the draft's rows ``start .. start + n`` (None: none)."""
        return None

    def _forward(
        self, batch: ForwardBatch, chunks: list[ForwardChunk], input_ids=None, hidden_in=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward, timed for the cost model: its logits (widened to the target's
        vocabulary) and, for a drafter that reads its own hidden state back (``state_layers``), that
        layer's output at the same rows."""
        self.num_forwards += 1
        lap = self.runner.lap()
        self.cache.overwrites(chunks)
        if input_ids is None and self.draft_vocab_size < self.vocab_size:
            batch.input_ids = batch.input_ids.clamp(max=self.draft_vocab_size - 1)
        out = self.runner.execute(batch, input_ids=input_ids, hidden_layers=self.state_layers, hidden_in=hidden_in)
        logits = out.logits
        if logits.shape[1] != self.vocab_size:
            wide = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            n = min(self.vocab_size, logits.shape[1])
            wide[:, :n] = logits[:, :n]
            logits = wide
        state = out.hidden_states[self.state_layers[0]].index_select(0, batch.logit_rows) if self.state_layers else None
        self._timings.append((self.cost.kind, batch.num_seqs, batch.num_tokens, lap.stop(), 1))
        return logits, state

    def _chain_levels(self, seqs: list[Sequence], ids: torch.Tensor, levels: int, temperature=None, noise=None):
        # Level d feeds its token at draft slot root + 1 + d, which is also its position: the levels
        # are a causal chunk of `levels` tokens after the root.
        # (lora: the target drafting for itself, layer skipping, runs each row under its adapter; a draft
        # model of its own has no adapters and ignores it)
        chunks = [
            ForwardChunk([0] * levels, s.num_tokens - self.shift, s.block_table, levels, lora=s.lora_slot) for s in seqs
        ]
        batches = self.runner.prepare_levels(chunks)
        self.cache.overwrites(chunks)
        if self.draft_vocab_size < self.vocab_size:
            ids = ids.clamp(max=self.draft_vocab_size - 1)
        self.num_forwards += levels
        lap = self.runner.lap()
        out, q = self.runner.chain(batches, ids, temperature, noise)
        # The cost model prices draft levels one by one: each gets its share of the call.
        self._timings.append((self.cost.kind, len(seqs), len(seqs), lap.stop(), levels))
        return out, q

    def _level(self, seqs, ids, per_seq, first, depth, masks=None, state=None):
        """Feed ``per_seq`` device-resident tokens per sequence at draft slots ``root + 1 + first[b] ...``,
        all at position ``root + depth`` (``root``: the draft row that gave level 1)."""
        chunks = []
        for b, s in enumerate(seqs):
            root = s.num_tokens - 1 - self.shift
            mask, mask_start = (masks[b], root + 1) if masks is not None else (None, None)
            positions = [root + depth] * per_seq
            slot = root + 1 + first[b]
            chunks.append(
                ForwardChunk([0] * per_seq, slot, s.block_table, per_seq, positions, mask, mask_start, lora=s.lora_slot)
            )
        if self.draft_vocab_size < self.vocab_size:
            ids = ids.clamp(max=self.draft_vocab_size - 1)
        return self._forward(self.runner.prepare(chunks), chunks, input_ids=ids.reshape(-1), hidden_in=state)

    # -- prefix reuse ---------------------------------------------------------------------------
    def _skip_cached_prefix(self, seq: Sequence) -> None:
        self.cache.skip_cached_prefix(seq)


def load_draft_runner(config, target: ModelRunner, tokenizer, method: str) -> ModelRunner:
    """The runner of ``--draft-model``, beside the target's (same device, block size and backend).
    Under tensor parallelism it runs unsharded on rank 0, or with ``--draft-tensor-parallel-size N``
    sharded like the target over its ranks (engine.runner.parallel.open_sharded)."""
    if not config.draft_model:
        raise ValueError(f"speculative method {method!r} needs --draft-model")
    path = resolve_model_path(config.draft_model)
    draft_config = load_config(path)
    check_same_vocabulary(tokenizer, load_tokenizer(path), draft_config, target.hf_config, path)
    max_positions = target.model.rope_cos.shape[0]
    dtype = draft_dtype(target, draft_config, max_positions)
    runner_kwargs = dict(
        block_size=config.block_size, compile=target.compiled, attention_backend=target.attention_backend,
        freeze=False,  # its levels run a row or two each
        cuda_graph_max_seqs=target.cuda_graph_max_seqs, kv_cache_dtype=target.kv_cache_dtype,
    )  # fmt: skip
    if config.draft_tensor_parallel_size > 1:
        from engine.runner.parallel import open_sharded

        args = (config.draft_model, dtype, max_positions, not target.compiled)
        return open_sharded(target, "draft model", draft_shard, args, **runner_kwargs)
    model = load_model(path, draft_config, dtype, target.device, max_positions, pack=not target.compiled)
    return ModelRunner(model, draft_config, target.device, dtype, **runner_kwargs)


def draft_shard(tp, device, target: ModelRunner, draft_model: str, dtype, max_positions: int, pack: bool):
    """A rank's shard of the draft model (``engine.runner.parallel.open_sharded``'s factory)."""
    path = resolve_model_path(draft_model)  # (in this host's cache)
    draft_config = load_config(path)
    return load_model(path, draft_config, dtype, device, max_positions, pack=pack, tp=tp), draft_config, dtype


def draft_dtype(target: ModelRunner, draft_config, max_positions: int) -> torch.dtype:
    """The draft's dtype: the target's, except on a CPU where the target runs in half precision, the
    small-rows bf16 kernel is unavailable (engine/models/small_linear.py: where it serves, a draft
    level's one or two rows stream bf16 weights faster than float32 ones) and the draft's float32
    weights fit in the last-level cache. There bandwidth does not limit the draft, and at the one or
    two rows a draft level runs, oneDNN's half-precision GEMMs cost more per call than float32's (the
    demo draft's forward: 0.44 ms in bf16, 0.25 ms in float32). The draft's own KV cache follows its
    dtype; its logits are float32 either way, so verification is unchanged."""
    if target.device.type != "cpu" or target.dtype == torch.float32:
        return target.dtype
    with torch.device("meta"):
        params = sum(p.numel() for p in model_class_for(draft_config)(draft_config, max_positions).parameters())
    # The kernel serves a draft loaded unpacked (compiled, or small: engine.runner.loader.load_model).
    unpacked = target.compiled or 2 * params < MIN_PACKED_BYTES
    if unpacked and small_rows_serve(target.dtype, target.device):
        return target.dtype
    return torch.float32 if 4 * params <= last_level_cache_bytes() else target.dtype


def last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache, as Linux reports it (0 where it does not)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes)


def check_same_vocabulary(target_tok, draft_tok, draft_config, target_config, draft_path) -> None:
    """A draft must speak the target's vocabulary: same ids for the same tokens."""
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"the draft model {draft_path} has a different tokenizer vocabulary from the target; "
            "speculative decoding needs the same tokenizer"
        )
    # Checkpoints of one family often pad their embedding tables differently (Qwen2.5-7B: 152064,
    # Qwen2.5-0.5B: 151936); that is fine as long as both cover the shared tokenizer.
    need = len(target_tok)
    for name, cfg in (("draft", draft_config), ("target", target_config)):
        if cfg.vocab_size < need:
            raise ValueError(f"the {name} model's vocab_size ({cfg.vocab_size}) is smaller than its tokenizer ({need})")
