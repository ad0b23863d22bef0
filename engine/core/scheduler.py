"""Iteration-level (continuous) batching with chunked prefill and recompute preemption.

Each step the scheduler decides which sequences run and how many of their uncomputed tokens each
feeds, under a per-step token budget. It speaks plain Python lists and never touches a tensor.

Terms: a *decode* is a running sequence with exactly one uncomputed token (its next input); its
*mandatory* token is that one, and a running prefill's mandatory tokens are its next chunk.
*Lookahead* slots are extra KV slots a decode may get past its mandatory token, for a speculative
draft the same forward verifies; each granted slot is one more token of that forward, so it is
charged to the token budget.

*Fair share* (the rule): no sequence takes more than its share of a step's token budget while
others wait for tokens. Its share is ``budget // claimants``, the *claimants* being the sequences
with tokens to feed this step: the running ones (parked ones aside) and the waiting ones that free
seats could admit. A sequence that wants more (a long prompt's next chunk, contrastive search's
candidates) gets its share, and more only from what is left once everyone else is seated,
admissions included (pass 3); drafts take only what is left after that (pass 4). So a request takes
at most ``max(its share, what is left after the others are seated)`` of a step, and one arriving
beside a wide request is seated in the next step instead of after it. Alone, a sequence's share is
the whole budget. Splitting changes no output: a prompt's chunks compute what one chunk would, and
contrastive search keeps its best candidate over the parts of its ``top_k``
(engine/decoding/contrastive_search.py).

Policy, in four passes:
1. Mandatory tokens. Running sequences, oldest first: decodes take one token, unfinished prefills
   take a chunk, contrastive search its candidates, each at most its share; a *parked* sequence (a
   beam whose logits row waits for its group's other beams: nothing to feed) takes none. When KV
   blocks run out, the newest parked sequence is preempted, or else the newest running one (its
   blocks freed; it waits at the front of the queue and is recomputed later — never dropped, never
   corrupted). No lookahead is granted here, so drafting can never starve a sequence of its token
   nor force a preemption.
2. Admission, only if nothing was preempted: waiting sequences are admitted in arrival order while
   the token budget, ``max_num_seqs`` and free blocks (less the watermark while anything runs)
   allow, reusing cached prefix blocks, each taking at most its share; parked ones are skipped (they
   wait for their group, not for compute). Where blocks are short, running parked sequences are
   preempted to admit a beam (maybe their missing mate), or anyone when nothing but parked sequences
   runs; when nothing runs at all, waiting choices give up the KV they hold (below).
3. What is left of the budget goes to the sequences that passes 1 and 2 held to their share, in the
   order they were seated, within the free blocks above the watermark (it never preempts).
4. Lookahead, only if nothing was preempted (a preemption means KV is short, and drafting would
   hold blocks the victim needs back). The decodes of pass 1, in running order, each get
   ``min(lookahead(seq), budget left)`` slots, shrunk to what the free pool gives without touching
   the ``watermark_blocks`` reserve that admission keeps; a partial grant (or none) is normal.
   Lookahead never preempts anyone, and never changes what the other passes give.

*Seats*: a request's first sequence, while on its prompt, holds a seat for each sequence its request
runs once the prompt is done: its beams (they step together, so all of them), or its ``n`` choices up
to ``max_num_seqs``. The choices beyond are forked all the same, sharing the prompt's blocks, but
*wait for a seat* in the queue, KV in hand: admitted, they decode at once, nothing recomputed. When
one is admitted, its request's other seat-waiting choices go behind the rest of the queue, so a
request with many choices takes the seats that free round-robin with the requests queued after it,
one request among others rather than the head of the queue until its last choice runs.

Every pass costs O(number of sequences) (lookahead also O(its blocks) per sequence).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv import BlockManager
from engine.request.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens it feeds)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write copies
    preempted: list[Sequence] = field(default_factory=list)
    lookahead: dict[int, int] = field(default_factory=dict)  # seq_id → extra slots reserved for drafts

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._limits = (max_num_seqs, max_num_batched_tokens)  # as configured: shrink() is undone by regrow()
        self._good_steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Keep a few blocks in reserve when admitting new work (or drafting) so running decodes
        # rarely preempt.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        # Cumulative counts for the metrics: prompt tokens looked up in the prefix cache on admission
        # (readmissions after a preemption included), how many of them hit, and preemptions.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a forked ``n > 1`` choice)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def add_forked(self, seq: Sequence, parent: Sequence) -> None:
        """A sequence just forked from ``parent``, sharing its blocks: it runs beside a running parent
        (a beam, or a choice in a seat its request's first sequence held for it), else it waits."""
        group = seq.group
        seated = group.beam is not None or seq.index < self._seats_held(group)
        if parent.status is SequenceStatus.RUNNING and seated:
            self.add_running(seq)
        else:
            self.add(seq)  # a choice beyond the seats waits for one, KV in hand

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_hashes.clear()
        seq.status = SequenceStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(
        self, token_budget: int | None = None, lookahead: Callable[[Sequence], int] | None = None
    ) -> SchedulerOutput:
        """One step's plan (see the module docstring for the three passes).

        ``lookahead(seq)``: extra KV slots a decoding sequence wants past its next token (for a
        speculative draft); it is asked only for decodes that got their token. What was granted
        is ``out.lookahead[seq.seq_id]`` (absent: none), possibly less than asked.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if token_budget is None else token_budget
        share = max(1, budget // self._claimants())
        held: list[int] = []  # indices into out.scheduled of sequences held to their share
        decodes, budget = self._schedule_running(budget, share, out, held)
        if out.preempted:
            return out
        budget = self._admit(budget, share, out, held)
        budget = self._give_what_is_left(budget, out, held)
        if lookahead is not None:
            self._grant_lookahead(decodes, lookahead, budget, out)
        return out

    def _claimants(self) -> int:
        """Sequences with tokens to feed this step (module docstring: *fair share*): the running ones with
        work, and the waiting ones the free seats could admit."""
        running = sum(1 for s in self.running if not s.parked and (s.num_uncomputed_tokens or s.num_candidates))
        seats = self.max_num_seqs - sum(self._seats(s) for s in self.running)
        waiting = min(sum(1 for s in self.waiting if not s.parked), max(seats, 0))
        return max(1, running + waiting)

    @staticmethod
    def _wants(seq: Sequence) -> tuple[int, int]:
        """(the first slot it writes, the tokens it would feed this step): its uncomputed tokens, or its
        contrastive-search candidates still to feed (after those fed before, in the slots they hold)."""
        return seq.num_computed_tokens + seq.num_candidates_fed, seq.num_uncomputed_tokens or seq.num_candidates

    def _schedule_running(
        self, budget: int, share: int, out: SchedulerOutput, held: list[int]
    ) -> tuple[list[Sequence], int]:
        """Pass 1: mandatory tokens, oldest first, each at most its share, preempting the newest when
        blocks run out. Returns the decodes scheduled and the budget left."""
        decodes: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start, want = self._wants(seq)
            n = min(want, budget, share)
            if seq.parked or not n:
                i += 1
                continue
            copies = self.bm.reserve(seq.block_table, start, start + n)
            while copies is None:
                parked = [s for s in self.running if s.parked]
                victim = parked[-1] if parked else self.running[-1]  # a parked one loses only its blocks
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.bm.reserve(seq.block_table, start, start + n)
            if copies is None:  # the sequence preempted itself: nothing after it is left to run
                break
            if n < want:
                held.append(len(out.scheduled))
            out.scheduled.append((seq, n))
            out.block_copies.extend(copies)
            if seq.num_uncomputed_tokens == 1:
                decodes.append(seq)
            budget -= n
            i += 1
        return decodes, budget

    def _give_what_is_left(self, budget: int, out: SchedulerOutput, held: list[int]) -> int:
        """Pass 3: the budget left, to the sequences held to their share, in the order they were seated,
        within the free blocks above the watermark (it preempts no one). Returns the budget left."""
        bm, bs = self.bm, self.bm.block_size
        for j in held:
            if budget <= 0:
                break
            seq, n = out.scheduled[j]
            start, want = self._wants(seq)
            spare = bm.num_free_blocks - self.watermark_blocks
            end = min(start + want, start + n + budget, (len(seq.block_table) + max(spare, 0)) * bs)
            if end <= start + n or (copies := bm.reserve(seq.block_table, start + n, end)) is None:
                continue
            out.scheduled[j] = (seq, end - start)
            out.block_copies.extend(copies)
            budget -= end - start - n
        return budget

    def _grant_lookahead(
        self, decodes: list[Sequence], lookahead: Callable[[Sequence], int], budget: int, out: SchedulerOutput
    ) -> None:
        """Pass 4: lookahead slots from the budget and free blocks the other passes left.

        A decode's mandatory slot was made writable in pass 1, so its draft slots start one past
        it. Slots in blocks the table already holds privately cost nothing; a new block, or a
        private copy of a shared one, costs one block of the spare pool (free blocks above the
        watermark). A grant stops at the last block that still fits, so it may be partial.
        """
        bm, bs = self.bm, self.bm.block_size
        spare = max(0, bm.num_free_blocks - self.watermark_blocks)
        for seq in decodes:
            if budget <= 0:
                break
            want = min(lookahead(seq), budget)
            if want <= 0:
                continue
            table = seq.block_table
            first = seq.num_computed_tokens + 1
            end = first + want
            limit, cost = first, 0  # slots [first, limit) fit within `cost` blocks of the spare pool
            for b in range(first // bs, -(-end // bs)):
                c = 1 if b >= len(table) or bm.ref_count(table[b]) > 1 else 0
                if cost + c > spare:
                    break
                cost += c
                limit = (b + 1) * bs
            extra = min(end, limit) - first
            if extra <= 0:
                continue
            copies = bm.reserve(table, first, first + extra)
            assert copies is not None, "the spare pool covers these blocks"
            out.block_copies.extend(copies)
            out.lookahead[seq.seq_id] = extra
            budget -= extra
            spare -= cost

    def _seats_held(self, group: SequenceGroup) -> int:
        """Seats a request's first sequence holds on its prompt (module docstring: *seats*)."""
        return group.width if group.beam is not None else min(group.width, self.max_num_seqs)

    def _seats(self, seq: Sequence) -> int:
        return self._seats_held(seq.group) if seq.index == 0 and seq.num_output_tokens == 0 else 1

    def _admit(self, budget: int, share: int, out: SchedulerOutput, held: list[int]) -> int:
        """Pass 2: admit waiting sequences in arrival order, each at most its share, keeping the watermark
        free. Returns the budget left."""
        seats = self.max_num_seqs - sum(self._seats(s) for s in self.running)
        queue = deque(s for s in self.waiting if not s.parked)  # a parked one has nothing to compute yet
        while queue and budget > 0:
            seq = queue[0]
            need_seats = self._seats(seq)
            if need_seats > seats:
                break
            in_hand = seq.awaits_seat
            plan = self._kv_in_hand(seq, min(budget, share)) if in_hand else self._kv_to_take(seq, min(budget, share))
            if plan is None:
                # Parked beams give way to a beam (perhaps their missing mate), or when nothing else
                # runs: parked sequences alone would wait for each other forever.
                stuck = seq.group.beam is not None or all(s.parked for s in self.running)
                if stuck and self._preempt_parked(out):
                    seats += 1
                    continue  # parked blocks were freed: try again
                if not self.running and self._drop_waiting_kv(seq, out):
                    continue
                break
            queue.popleft()
            self.waiting.remove(seq)
            n, prefix_blocks, prefix_hashes = plan
            if not in_hand:
                cached = len(prefix_blocks) * self.bm.block_size
                self.bm.take_prefix(seq.block_table, seq.block_hashes, prefix_blocks, prefix_hashes)
                seq.num_computed_tokens = cached
                if seq.group.num_cached_prompt_tokens is None:  # the request's first admission (not a return
                    seq.group.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)  # after preemption)
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += cached
            start = seq.num_computed_tokens
            copies = self.bm.reserve(seq.block_table, start, start + n)
            assert copies is not None, "can_allocate promised these blocks"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if n < seq.num_uncomputed_tokens:
                held.append(len(out.scheduled))
            out.scheduled.append((seq, n))
            out.block_copies.extend(copies)
            budget -= n
            seats -= need_seats
            if in_hand and self._requeue_mates(seq):
                queue = deque(s for s in self.waiting if not s.parked)
        return budget

    def _kv_to_take(self, seq: Sequence, budget: int) -> tuple[int, list[int], list[int]] | None:
        """(tokens it feeds, cached prefix blocks and their hashes) for a sequence that holds no KV, or
        None when the blocks it needs are short."""
        if seq.search is not None:
            prefix_blocks, prefix_hashes = [], []  # every prompt position must be computed
        else:
            prefix_blocks, prefix_hashes = self.bm.match_prefix(seq.token_ids[: self._cacheable(seq)], seq.kv_root)
        cached = len(prefix_blocks) * self.bm.block_size
        n = min(seq.num_tokens - cached, budget)
        new_blocks = self.bm.blocks_needed(len(prefix_blocks), cached + n)
        reserve = self.watermark_blocks if self.running else 0  # an idle engine may use every block
        if not self.bm.can_allocate(prefix_blocks, new_blocks + reserve):
            return None
        return n, prefix_blocks, prefix_hashes

    def _kv_in_hand(self, seq: Sequence, budget: int) -> tuple[int, list[int], list[int]] | None:
        """The same for a choice that waited for a seat with its KV: its next chunk (its next token)
        costs a block past its table, or a private copy of a shared one."""
        bm, bs, table = self.bm, self.bm.block_size, seq.block_table
        start = seq.num_computed_tokens
        n = min(seq.num_uncomputed_tokens, budget)
        blocks = range(start // bs, -(-(start + n) // bs))
        cost = sum(1 for b in blocks if b >= len(table) or bm.ref_count(table[b]) > 1)
        reserve = self.watermark_blocks if self.running else 0
        return (n, [], []) if bm.can_allocate([], cost + reserve) else None

    def _requeue_mates(self, seq: Sequence) -> bool:
        """Move the seat-waiting choices of ``seq``'s request behind the rest of the queue (module
        docstring: *seats*). False if it has none."""
        mates = [s for s in self.waiting if s.group is seq.group and s.awaits_seat]
        if not mates:
            return False
        rest = [s for s in self.waiting if s.group is not seq.group or not s.awaits_seat]
        self.waiting.clear()
        self.waiting.extend(rest + mates)
        return True

    def _drop_waiting_kv(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Nothing runs and ``seq`` does not fit: the newest other choice waiting with KV in hand gives it
        up (it is recomputed when admitted, as after a preemption). Once none holds any, the sequence
        fits: one sequence's chunk always fits an idle pool. False if none holds any."""
        holder = next((s for s in reversed(self.waiting) if s.awaits_seat and s is not seq), None)
        if holder is None:
            return False
        self.bm.free(holder.block_table)
        holder.block_hashes.clear()
        holder.num_computed_tokens = 0
        holder.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(holder)
        return True

    @staticmethod
    def _cacheable(seq: Sequence) -> int:
        """How many leading tokens a cached prefix may stand for, plus one (``match_prefix`` leaves the
        last token it is given to compute). A prompt whose logprobs are asked for computes every position
        not yet scored: none on its first admission, those after the ones it scored before a preemption
        cut its prefill short."""
        group = seq.group
        if seq.params.prompt_logprobs is not None and len(group.prompt_logprobs) < group.num_prompt_tokens:
            return len(group.prompt_logprobs)
        return seq.num_tokens

    def _preempt_parked(self, out: SchedulerOutput) -> bool:
        """Free the newest running parked sequence's blocks for the admission (its beam mates may be the
        ones waiting: parked beams must not hold the blocks those need). It keeps its logits row and
        waits, parked, for its group's step. False if none is running."""
        parked = [s for s in self.running if s.parked]
        if not parked:
            return False
        self._preempt(parked[-1], out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.preempt(seq)
        out.preempted.append(seq)

    def shrink(self, num_in_step: int, min_tokens: int) -> bool:
        """Halve the step (token budget and sequences, from the ``num_in_step`` of the step that did
        not fit). False when it is already as small as it gets."""
        if num_in_step <= 1 and self.max_num_batched_tokens <= min_tokens:
            return False
        self.max_num_batched_tokens = max(min_tokens, self.max_num_batched_tokens // 2)
        self.max_num_seqs = max(1, min(self.max_num_seqs, num_in_step) // 2)
        self._good_steps = 0
        return True

    def regrow(self, every: int = 64) -> None:
        """After ``every`` steps that fit, double the limits back towards the configured ones."""
        seqs, tokens = self._limits
        if self.max_num_seqs >= seqs and self.max_num_batched_tokens >= tokens:
            return
        self._good_steps += 1
        if self._good_steps >= every:
            self._good_steps = 0
            self.max_num_seqs = min(seqs, self.max_num_seqs * 2)
            self.max_num_batched_tokens = min(tokens, self.max_num_batched_tokens * 2)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
