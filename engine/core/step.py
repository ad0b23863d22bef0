"""The engine step, read top to bottom: plan → schedule → propose → build → forward → accept → commit.

Plain decoding is the same step with no drafts: a decode is a root with an empty tree, a prefill
chunk that finishes its prompt samples its first token the same way. Each stage calls the module
that owns it: the controller (depths), the scheduler (who runs, KV slots), the proposer (trees),
the model runner (the one batched target forward), ``verify`` (what is accepted), and
``engine/decoding`` (beam search, contrastive search and decoding: one call per stage).

Terms: the *root* of a sequence is its last token, not yet in the target's cache; its draft tree's
nodes follow it in the forward, rows ``[root, node 0, node 1, …]``. *Accepted* nodes are those the
target kept; the *final* token is the recovered or bonus token sampled after them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from engine.attention.staging import to_device
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.decoding.beam import BeamSearch
from engine.decoding.strategies import Strategies
from engine.request.confine import Confine
from engine.request.sequence import Sequence
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.sampling.accept import ACCEPT, RowsMetadata, acceptance_kind, count_tokens
from engine.sampling.batch import Batch, Emit, Sample
from engine.sampling.constrain import Constraints
from engine.sampling.logprobs import LogprobRows, record_prompt_logprobs, wants_prompt_logprobs
from engine.sampling.tree import DraftTree, tree_layout
from engine.speculative.proposer import ExtraRows, ProposeContext, Proposer, VerifyRows
from engine.speculative.stats import SpecStats

_EMPTY = DraftTree()


class Step:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        proposer: Proposer | None,
        controller,  # engine.speculative.controller.SpecController | None
        fork: Callable[[Sequence], list[Sequence]],  # forks a request's other n - 1 choices off its first
        beams: BeamSearch,
        eos_token_ids: list[int],
        max_model_len: int,
        jump_forward: bool = True,
        confine: Confine | None = None,  # per-request host work: an exception fails its request alone
    ) -> None:
        self.runner, self.scheduler, self.proposer, self.controller = runner, scheduler, proposer, controller
        self.fork = fork
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = SpecStats(controller.max_depth if controller else 0)
        self.hidden_layers = proposer.hidden_layers if proposer else ()
        self._hidden: dict[int, dict[int, torch.Tensor]] = {}  # seq_id → last forward's final rows
        self.rows = RowsMetadata(runner.vocab_size, runner.device, eos_token_ids)
        self.constraints = Constraints(jump_forward)  # structured outputs: cuts, grammar advance, jump-forward
        self._cuts: dict[int, Sample] = {}  # seq_id → its draft cut by its grammar, this step
        self._extra: dict[int, ExtraRows] = {}  # seq_id → the proposer's own rows in this step's forward
        self._planned: dict[int, int] = {}  # seq_id → the depth its draft was granted, this step
        self._decoding: set[int] = set()  # seq_ids the controller planned for (decodes), this step
        self.confine = confine or Confine()
        self.decoding = Strategies(beams, proposer, self.rows, self.confine)  # beyond sampling: engine/decoding/
        self.scheduled: list[Sequence] = []  # this step's sequences (the engine fails them if it raises)
        # A plan the engine asked for this step already (run-ahead decoding asks the controller whether
        # a step drafts before it launches that step's forward; a step that drafts, or whose launch found
        # no KV slots, runs as an ordinary step on this plan: each step's plan is asked once, its
        # exploration counted once).
        self.next_plan: dict[int, int] | None = None
        self.next_plan_seconds = 0.0  # (what making it took: part of that step's time)
        self.forward_seconds = 0.0  # this step's target and proposer forwards (the rest is host work)

    def run(self) -> tuple[list[Emit], list[Sequence]]:
        """One step: what each sequence emitted, and sequences with news but no token of their own."""
        t0 = time.perf_counter()
        self.forward_seconds, self.scheduled = 0.0, []
        if self.next_plan is None:
            want = self.plan()
        else:
            want, self.next_plan, t0 = self.next_plan, None, t0 - self.next_plan_seconds
        sched = self.scheduler.schedule(lookahead=self._lookahead(want) if want else None)
        if not sched.scheduled:
            return [], []
        self.scheduled = [seq for seq, _ in sched.scheduled]
        self.mirror(sched)
        trees = self.propose(sched, want)
        batch = self.build(sched, trees)
        if not batch.chunks:  # every request scheduled failed before the forward (engine/request/confine.py)
            return [], []
        out, lap = self.target_forward(batch)
        self.advance(batch, out)
        emits = self.accept(batch, out.logits, out.final_hidden)
        self.timed(batch, lap)
        self.commit(batch, emits, out.hidden_states)
        self.feedback(batch, emits, out.logits)
        record_prompt_logprobs(out.logits, batch.prompt_spans, self.confine)
        if self.controller is not None:
            tokens, seconds = sum(len(e.tokens) for e in emits), time.perf_counter() - t0
            self.controller.observe_step(len(self.scheduled), tokens, seconds, self.forward_seconds, len(trees), batch)
        return emits, [s for s, *_ in batch.prompt_spans] + batch.ended

    # 1. plan: a draft depth per decoding sequence (absent = none)
    def plan(self, ahead: int = 0) -> dict[int, int]:
        """``ahead``: tokens each running sequence has on the device, not yet read (run-ahead decoding
        asks for the step after them)."""
        self._decoding = set()
        if self.controller is None:
            return {}
        # A decode has output already: a prompt whose last chunk is one token samples its first token
        # (and forks its n > 1 choices) the plain way.
        decode = [
            s
            for s in self.scheduler.running
            if s.num_uncomputed_tokens + ahead == 1 and s.num_output_tokens + ahead > 0
        ]
        if not decode:
            return {}
        other = sum(s.num_uncomputed_tokens for s in self.scheduler.running if s.num_uncomputed_tokens > 1)
        other += sum(s.num_tokens for s in itertools.islice(self.scheduler.waiting, 4))  # likely admissions
        # Never draft past max_tokens or the context: the final token takes the last place.
        room = [max(s.tokens_left(self.max_model_len) - 1 - ahead, 0) for s in decode]
        depths = self.controller.plan(decode, min(other, self.scheduler.max_num_batched_tokens), room)
        self._decoding = {s.seq_id for s in decode}
        return {s.seq_id: d for s, d in zip(decode, depths) if d > 0}

    def plan_ahead(self, ahead: int) -> dict[int, int]:
        """Plan the step after the running sequences' ``ahead`` tokens on the device (run-ahead decoding
        asks before it launches that step's forward) and keep the plan for that step, with its time,
        until the engine launches the forward (then ``next_plan`` is cleared) or the step runs on it."""
        t0 = time.perf_counter()
        self.next_plan = self.plan(ahead)
        self.next_plan_seconds = time.perf_counter() - t0
        return self.next_plan

    def _lookahead(self, want: dict[int, int]) -> Callable[[Sequence], int]:
        return lambda seq: self.proposer.slots_for(seq.spec_route, want.get(seq.seq_id, 0), seq.params.greedy)

    def mirror(self, sched: SchedulerOutput) -> None:
        """Keep every cache and the proposer in step with what the scheduler did."""
        self.runner.copy_blocks(sched.block_copies)
        if self.proposer is not None:
            self.proposer.copy_blocks(sched.block_copies)
            for seq in sched.preempted:
                self._lost_kv(seq)

    # 2. propose: a tree per drafting sequence, as deep as its granted KV slots allow
    def propose(self, sched: SchedulerOutput, want: dict[int, int]) -> dict[int, DraftTree]:
        seqs, depths = [], []
        for seq, _ in sched.scheduled:
            d = want.get(seq.seq_id, 0)
            slots = sched.lookahead.get(seq.seq_id, 0)
            d = self.proposer.depth_for_slots(slots, d, seq.params.greedy, seq.spec_route) if d else 0
            if d > 0:
                seqs.append(seq)
                depths.append(d)
        self._cuts, self._extra = {}, {}
        self._planned = {s.seq_id: d for s, d in zip(seqs, depths)}
        if not seqs:
            self._no_drafts(sched, {})
            return {}
        ctx = ProposeContext({s.seq_id: self._hidden[s.seq_id] for s in seqs if s.seq_id in self._hidden})
        trees = self.proposer.propose(seqs, depths, ctx)
        for kind, num_seqs, tokens, seconds in self.proposer.timings():
            self.controller.cost.observe(kind, num_seqs, tokens, seconds)
            self.forward_seconds += seconds
        for s, t in zip(seqs, trees):
            if len(t) and s.grammar and (cut := self.confine.run(s.group, self.constraints.cut, s, t)) is not None:
                self._cuts[s.seq_id] = cut
        drafts = [(s, t) for s, t in zip(seqs, trees) if self.confine.ok(s.group)]  # (a failed one feeds nothing)
        for s, t in drafts:  # rows of the proposer's own, in the slots the tree left
            kept = self._cuts[s.seq_id].tree if s.seq_id in self._cuts else t
            room = self.max_model_len - s.num_tokens - len(kept)  # its slots stay within the context
            slots = min(sched.lookahead.get(s.seq_id, 0) - len(kept), room)
            extra = self.proposer.extra_rows(s, kept, slots)
            if extra is not None and len(extra):
                # Its rows write KV slot by slot after the tree's: past the grant they would overwrite
                # another sequence's.
                if len(extra) > slots or min(extra.offsets) < 1 or max(extra.offsets) > slots:
                    raise RuntimeError(f"the {self.proposer.method} proposer's rows exceed their {slots} slots")
                self._extra[s.seq_id] = extra
        trees = {s.seq_id: t for s, t in drafts if len(t) or s.seq_id in self._extra}
        for s, t in drafts:  # asked for a draft: had one (a lookup may have found nothing)
            self.controller.asked(s, t.source or None, s.seq_id in trees)
        self._no_drafts(sched, trees)
        return trees

    def _no_drafts(self, sched: SchedulerOutput, trees: dict[int, DraftTree]) -> None:
        """Count, per request, the decode steps it went without a draft, by the reason in a word
        (``usage.speculative.reason``): the plan's (SpecController.plan), ``grammar`` where its grammar
        cut the draft to nothing, ``acceptance`` where the proposer found nothing to draft."""
        for seq, _ in sched.scheduled:
            sid, cut = seq.seq_id, self._cuts.get(seq.seq_id)
            drafted = sid in trees and (sid in self._extra or len(cut.tree if cut else trees[sid]) > 0)
            if sid not in self._decoding or drafted:
                continue
            if cut is not None:
                reason = "grammar"
            elif sid in self._planned:
                reason = "acceptance"
            else:
                reason = seq.spec_reason
            if reason is not None:
                seq.group.spec_reasons[reason] = seq.group.spec_reasons.get(reason, 0) + 1

    # 3. build the one forward: prefill chunks, plain decodes and draft trees side by side
    def build(self, sched: SchedulerOutput, trees: dict[int, DraftTree]) -> Batch:
        b = Batch()
        scheduled = [(seq, n) for seq, n in sched.scheduled if self.confine.ok(seq.group)]  # a failed one feeds nothing
        searching, row = self.decoding.build(b, scheduled)  # contrastive search's candidates
        tok = row
        for seq, n in [(seq, n) for seq, n in scheduled if seq.seq_id not in searching]:
            start = seq.num_computed_tokens
            if seq.seq_id in trees:
                sample = self._cuts.get(seq.seq_id) or Sample(seq, trees[seq.seq_id], 0, 0)
                tree = sample.tree  # what the grammar left of it, if any
                lay = tree_layout(tree)
                ids = [seq.token_ids[start]] + tree.tokens
                positions = [start + d for d in lay.depths]
                mask = lay.mask
                if (extra := self._extra.get(seq.seq_id)) is not None:  # after the tree: slots released after
                    ids += extra.tokens
                    positions += [start + o for o in extra.offsets]
                    mask = extra.beside(mask, len(tree) + 1)
                    sample.extra = len(extra)
                b.chunks.append(
                    ForwardChunk(ids, start, seq.block_table, len(ids), positions, mask, lora=seq.lora_slot)
                )
                # A proposer with rows of its own is judged at the depth it was granted (what its rows
                # and slots were priced at), however short its tree came out: positions it did not
                # draft count as misses.
                depth = max(sample.drafted.depth, self._planned[seq.seq_id]) if sample.extra else sample.drafted.depth
                sample.row, sample.tok, sample.depth = row, tok, depth
                b.samples.append(sample)
                row, tok = row + len(ids), tok + len(ids)
                continue
            done, group, wants_prompt = start + n == seq.num_tokens, seq.group, wants_prompt_logprobs(seq, start)
            num_logits = n if wants_prompt else int(done)
            b.chunks.append(
                ForwardChunk(seq.token_ids[start : start + n], start, seq.block_table, num_logits, lora=seq.lora_slot)
            )
            b.computed.append((seq, start, n, tok))
            if wants_prompt:
                b.prompt_spans.append((seq, row, start, n))
            if done:
                fork = group.params.n > 1 and len(group.seqs) == 1 and group.beam is None
                b.samples.append(Sample(seq, _EMPTY, row + num_logits - 1, tok + n - 1, fork=fork))
            row, tok = row + num_logits, tok + n
        return b

    # 4. one batched target forward, timed without waiting for it (engine/runner/timing.py)
    def target_forward(self, b: Batch):
        lap = self.runner.lap()
        out = self.runner.forward(b.chunks, hidden_layers=self.hidden_layers)
        return out, lap.stop()

    def timed(self, b: Batch, lap) -> None:
        """The target forward's time, read once acceptance has waited for the device (the step's one
        sync on a GPU: the accepted tokens)."""
        self.forward_seconds += lap.seconds
        if self.controller is not None:
            tokens = sum(len(c.token_ids) for c in b.chunks)
            self.controller.cost.observe("target", len(b.chunks), tokens, lap.seconds)

    def advance(self, b: Batch, out) -> None:
        """Prefill chunks and plain decodes are final as fed."""
        for seq, start, n, tok in b.computed:
            seq.num_computed_tokens = start + n
            self.scheduler.bm.commit(
                seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens, seq.kv_root
            )
            self._computed(seq, start, out.hidden_states, list(range(tok, tok + n)))
            if seq.search is not None:
                self.confine.run(seq.group, self.decoding.search.record, seq, start, out.final_hidden[tok : tok + n])

    # 5. accept: greedy rows by argmax, sampling rows by lossless rejection sampling (seeded rows by the
    # drafter-invariant rule; typical acceptance, lossy, only where a request asked for it)
    def accept(self, b: Batch, logits: torch.Tensor, final_hidden: torch.Tensor | None = None) -> list[Emit]:
        for s in list(b.samples):
            if s.fork:  # the other choices of an n > 1 request draw their first token from the same row
                children = self.confine.run(s.seq.group, self.fork, s.seq) or []
                b.samples.extend(Sample(c, _EMPTY, s.row, s.tok) for c in children)
                if s.seq.seq_id in self._hidden:  # same prefix, same hidden states: they draft next step too
                    self._hidden.update((c.seq_id, self._hidden[s.seq.seq_id]) for c in children)
        b.samples = [s for s in b.samples if self.confine.ok(s.seq.group)]
        shaped, b.ended = self.decoding.take(b, logits)
        results = {}
        for part, accept in ACCEPT.items():
            samples = [s for s in b.samples if acceptance_kind(s) == part]
            results.update(zip(map(id, samples), accept(samples, shaped, self.rows) if samples else []))
        emits = self.decoding.choose(b, logits, final_hidden)
        for s in b.samples:
            nodes, final = results[id(s)]
            emits.append(Emit(s.seq, [s.tree.tokens[i] for i in nodes] + [final]))
            s.accepted = nodes
            if s.seq.params.include_speculation:
                emits[-1].provenance = self._provenance(s, nodes)
        asked = [(s, e) for s, e in zip(b.samples, emits[len(b.searches) :]) if s.seq.params.logprobs is not None]
        requests = [([s.row] + [s.row + 1 + i for i in s.accepted], e.tokens, s.seq.params.logprobs) for s, e in asked]
        rows = LogprobRows(logits, requests)
        for i, (s, e) in enumerate(asked):
            e.logprobs = self.confine.run(s.seq.group, rows.of, i)
        for e in emits:
            if e.seq.grammar is not None:
                self.confine.run(e.seq.group, self.constraints.advance, e, self.max_model_len)
        return emits

    def _provenance(self, s, nodes: list[int]) -> list[tuple[str, str | None, int]]:
        """How each token of ``s``'s emit came (engine.sampling.batch.PROVENANCE): its accepted draft
        tokens, then the target's own: a bonus after a path accepted to a leaf, else recovered."""
        if not len(s.tree):
            return [("plain", None, 0)]
        source = s.drafted.source or self.proposer.method
        last = nodes[-1] if nodes else -1
        leaf = last not in s.tree.parents
        return [("accepted", source, s.depth)] * len(nodes) + [("bonus" if leaf else "recovered", source, s.depth)]

    # 6. commit: accepted K/V into place, rejected slots released, everyone told what happened
    def commit(self, b: Batch, emits: list[Emit], hidden: dict[int, torch.Tensor]) -> None:
        bs = self.runner.block_size
        slot = lambda seq, i: seq.block_table[i // bs] * bs + i % bs  # noqa: E731
        src, dst = self.decoding.place(b, self.scheduler.bm, slot, self.runner.vocab_size)
        for s, e in zip(b.samples, emits[len(b.searches) :]):
            if not self.confine.ok(s.seq.group):  # (its blocks are freed once the step is over)
                continue
            count_tokens(s.seq, e.tokens, self.runner.vocab_size)
            drafted = s.drafted
            if not len(drafted) and not s.extra:  # a plain decode: final as fed (advance)
                continue
            seq, c, a = s.seq, s.seq.num_computed_tokens, len(s.accepted)
            for i, node in enumerate(s.accepted):  # node i of the path belongs at position c + 1 + i
                if node != i:
                    src.append(slot(seq, c + 1 + node))
                    dst.append(slot(seq, c + 1 + i))
            seq.num_computed_tokens = c + 1 + a
            # Rejected nodes' and extra rows' slots go back.
            self.scheduler.bm.release_tail(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
            if len(drafted):  # the proposer hears of its own tree: a grammar's cut maps the kept nodes back
                kept = s.accepted if s.kept is None else [s.kept[i] for i in s.accepted]
                self.proposer.on_verified(seq, drafted, kept)
            self._computed(seq, c, hidden, [s.tok] + [s.tok + 1 + i for i in s.accepted])
            self.controller.update(seq, s.depth, a, drafted.source or None)
            if not len(drafted):  # only extra rows: no draft to count
                continue
            source = drafted.source or self.proposer.method
            self.stats.record(len(drafted), a, source)
            seq.group.num_draft_tokens += len(drafted)
            seq.group.num_accepted_tokens += a
            tally = seq.group.drafted_by.setdefault(source, [0, 0])
            tally[0] += len(drafted)
            tally[1] += a
        self.runner.move_slots(src, dst)

    def feedback(self, b: Batch, emits: list[Emit], logits: torch.Tensor) -> None:
        """What the target said over the proposer's rows and, if it reads them, its trees', in one call."""
        trees = self.proposer is not None and self.proposer.reads_verify_logits
        if self._extra or trees:
            rows = [
                VerifyRows(s.seq, s.tree, s.accepted, e.tokens, s.row, self._extra.get(s.seq.seq_id))
                for s, e in zip(b.samples, emits[len(b.searches) :])
                if (s.extra or (trees and len(s.tree))) and self.confine.ok(s.seq.group)
            ]
            if rows:
                self.proposer.on_verify_logits(rows, logits)

    def _computed(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor], toks: list[int]) -> None:
        if self.proposer is None:
            return
        rows = {}
        if hidden:
            idx = to_device(toks, self.runner.device, torch.int64)
            rows = {layer: h.index_select(0, idx) for layer, h in hidden.items()}
            self._hidden[seq.seq_id] = rows
        self.proposer.on_computed(seq, start, rows)

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's KV away (it is recomputed from its tokens later)."""
        self.scheduler.preempt(seq)
        self._lost_kv(seq)

    def _lost_kv(self, seq: Sequence) -> None:
        self._hidden.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.on_preempt(seq)

    def forget(self, seq: Sequence) -> None:
        """A sequence finished or was aborted."""
        self._hidden.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.on_free(seq)
