"""Iteration-level (continuous) batching with chunked prefill and recompute preemption.

Each step the scheduler decides which sequences run and how many of their uncomputed tokens each
feeds, under a per-step token budget. It speaks plain Python lists and never touches a tensor.

Policy, in order:
1. Running sequences, oldest first: decodes take one token, unfinished prefills take a chunk. When
   KV blocks run out, the newest running sequence is preempted (its blocks freed; it waits at the
   front of the queue and is recomputed later — never dropped, never corrupted).
2. If nothing was preempted, waiting sequences are admitted in arrival order while the token budget,
   ``max_num_seqs`` and free blocks allow, reusing cached prefix blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv import BlockManager
from engine.sequence import Sequence, SequenceStatus


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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Keep a few blocks in reserve when admitting new work so running decodes rarely preempt.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    # -- queue management --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a forked ``n > 1`` choice)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

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
        """``lookahead(seq)``: extra KV slots a decoding sequence wants past its next token (for a
        speculative draft). They are granted only when the budget and free blocks allow — drafting
        never preempts anyone."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if token_budget is None else token_budget

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            extra = lookahead(seq) if lookahead is not None and seq.num_uncomputed_tokens == 1 else 0
            extra = min(extra, budget - n)
            if extra > 0:
                end = seq.num_computed_tokens + n + extra
                copies = self.bm.reserve(seq.block_table, seq.num_computed_tokens, end)
                if copies is not None:
                    out.scheduled.append((seq, n))
                    out.block_copies.extend(copies)
                    out.lookahead[seq.seq_id] = extra
                    budget -= n + extra
                    i += 1
                    continue
            copies = self.bm.reserve(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + n)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.bm.reserve(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + n)
            if copies is None:  # the sequence preempted itself: nothing after it is left to run
                break
            out.scheduled.append((seq, n))
            out.block_copies.extend(copies)
            budget -= n
            i += 1

        if out.preempted:
            return out
        seats = self.max_num_seqs - sum(s.group.params.n if s.num_output_tokens == 0 else 1 for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            need_seats = seq.group.params.n if seq.num_output_tokens == 0 and seq.index == 0 else 1
            if need_seats > seats:
                break
            if seq.params.prompt_logprobs is not None and not seq.group.prompt_logprobs:
                prefix_blocks, prefix_hashes = [], []  # every prompt position must be computed
            else:
                prefix_blocks, prefix_hashes = self.bm.match_prefix(seq.token_ids)
            cached = len(prefix_blocks) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget)
            new_blocks = self.bm.blocks_needed(len(prefix_blocks), cached + n)
            reserve = self.watermark_blocks if self.running else 0  # an idle engine may use every block
            if not self.bm.can_allocate(prefix_blocks, new_blocks + reserve):
                break
            self.waiting.popleft()
            self.bm.take_prefix(seq.block_table, seq.block_hashes, prefix_blocks, prefix_hashes)
            seq.num_computed_tokens = cached
            copies = self.bm.reserve(seq.block_table, cached, cached + n)
            assert copies is not None, "can_allocate promised these blocks"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            out.block_copies.extend(copies)
            budget -= n
            seats -= need_seats
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's KV; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.draft_num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
