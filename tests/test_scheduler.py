"""Unit tests for the scheduler: plain Python, no model, no torch tensors.

The engine's part is played by :func:`advance`: whatever a step fed is computed, a sequence whose
tokens are all computed samples one more (plus however many of its granted draft slots were
"accepted"), and rejected draft slots are released — so the block pool evolves as in the engine.
The scenarios pin the two ways lookahead used to hurt plain decoding (a decode starved of its
token, a sequence preempted to make room for someone's draft); the randomized test checks the
policy's invariants over a few hundred steps, comparing every step with the same step scheduled
without lookahead.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable

from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.kv import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence, SequenceGroup, SequenceStatus

_request_ids = itertools.count()
_tokens = itertools.count(1000)  # distinct token ids, so deterministic tests never share a prefix


def make_seq(prompt: list[int] | int, n: int = 1, max_tokens: int = 1000) -> Sequence:
    """The first sequence of a new request; an int prompt means that many fresh token ids."""
    if isinstance(prompt, int):
        prompt = [next(_tokens) for _ in range(prompt)]
    group = SequenceGroup(f"req-{next(_request_ids)}", prompt, SamplingParams(n=n, max_tokens=max_tokens), 0.0)
    return group.seqs[0]


def fork(sched: Scheduler, parent: Sequence) -> Sequence:
    """Another choice of ``parent``'s request sharing its blocks, as the engine forks ``n > 1`` requests."""
    child = Sequence(parent.group, parent.prompt_ids, index=len(parent.group.seqs))
    child.block_table = sched.bm.fork(parent.block_table)
    child.block_hashes = list(parent.block_hashes)
    child.num_computed_tokens = parent.num_computed_tokens
    parent.group.seqs.append(child)
    sched.add_running(child)
    return child


def advance(sched: Scheduler, out: SchedulerOutput, accept: Callable[[int], int] = lambda granted: 0) -> None:
    """Play the engine after the forward: ``accept(granted)`` draft tokens of a decode are accepted."""
    bm = sched.bm
    for seq, n in out.scheduled:
        if seq.num_computed_tokens + n < seq.num_tokens:  # a prefill chunk short of the prompt's end
            seq.num_computed_tokens += n
            bm.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
            continue
        granted = out.lookahead.get(seq.seq_id, 0)
        a = accept(granted)
        seq.num_computed_tokens += n + a
        seq.token_ids.extend(next(_tokens) for _ in range(a + 1))  # accepted drafts + the bonus token
        if granted:
            bm.release_tail(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
        bm.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)


def start_decodes(sched: Scheduler, prompt_lens: list[int]) -> list[Sequence]:
    """Admit and prefill one prompt per length in one step; each is then a decode (one uncomputed token)."""
    seqs = [make_seq(n) for n in prompt_lens]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule(token_budget=10**6)
    assert [s for s, _ in out.scheduled] == seqs, "setup: every prompt must fit in the pool"
    advance(sched, out)
    assert all(s.num_uncomputed_tokens == 1 for s in seqs)
    return seqs


def asking(want: dict[int, int], asked: list[int]) -> Callable[[Sequence], int]:
    """A lookahead that wants ``want[seq_id]`` slots and notes, in order, whom the scheduler asked."""

    def lookahead(seq: Sequence) -> int:
        asked.append(seq.seq_id)
        return want[seq.seq_id]

    return lookahead


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in out.scheduled]


# -- the two regressions ----------------------------------------------------------------------------
def test_every_decode_gets_its_token_before_any_lookahead() -> None:
    """9 decodes × (1 + 11) tokens exceed a 96-token budget: the ninth must still get its token."""
    bm = BlockManager(256, 16, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=96)
    seqs = start_decodes(sched, [8] * 9)

    out = sched.schedule(lookahead=lambda s: 11)

    assert plan(out) == [(s.seq_id, 1) for s in seqs]
    assert not out.preempted
    # 87 tokens left after the 9 mandatory ones, handed out in running order.
    assert [out.lookahead.get(s.seq_id, 0) for s in seqs] == [11] * 7 + [10, 0]
    assert out.num_tokens + sum(out.lookahead.values()) == 96
    bm.check_invariants()


def test_lookahead_never_forces_a_preemption() -> None:
    """Every decode needs a fresh block for its token; the drafts may only use what is left after that."""
    bm = BlockManager(10, 4, enable_prefix_caching=False)  # watermark: 1 block
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = start_decodes(sched, [8, 8, 8])  # 2 blocks each; slot 8 starts a third block
    assert bm.num_free_blocks == 4

    without = copy.deepcopy(sched).schedule(lookahead=None)
    out = sched.schedule(lookahead=lambda s: 4)

    assert not without.preempted and not out.preempted
    assert plan(out) == plan(without) == [(s.seq_id, 1) for s in seqs]
    # Each draft shrinks to the 3 slots left in the block its token just took: a fourth slot would
    # need a new block, and the one free block is the watermark.
    assert out.lookahead == {s.seq_id: 3 for s in seqs}
    assert bm.num_free_blocks == sched.watermark_blocks == 1
    bm.check_invariants()


# -- watermark, partial grants, mixed batches ------------------------------------------------------
def test_a_waiting_prompt_is_seated_before_drafts_which_keep_above_the_watermark() -> None:
    """A waiting prompt is a claimant of the step (the scheduler's fairness rule): it is admitted before
    anyone drafts. Drafts then take spare blocks only above the watermark, so the running decodes'
    reserve stays whole; nobody is preempted."""
    bm = BlockManager(200, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    assert sched.watermark_blocks == 2
    filler, a, b = start_decodes(sched, [763, 8, 8])  # 191 + 2 + 2 blocks; the filler's slot 763 is held
    assert bm.num_free_blocks == 5
    waiting = make_seq(4)
    sched.add(waiting)

    out = sched.schedule(lookahead=lambda s: 10)

    # A block each for a and b and one for the prompt (2 free: the watermark). No spare block is left
    # above it: the filler, whose next draft slot needs a new block, drafts nothing; a and b draft into
    # the rest of the block their token took.
    assert plan(out) == [(filler.seq_id, 1), (a.seq_id, 1), (b.seq_id, 1), (waiting.seq_id, 4)]
    assert out.lookahead == {a.seq_id: 3, b.seq_id: 3}
    assert bm.num_free_blocks == sched.watermark_blocks
    assert not out.preempted and not sched.waiting

    # Rejected drafts come back; the next step schedules every sequence without preempting (the
    # decodes' own tokens may use the reserve: that is what it is kept for).
    advance(sched, out)
    out = sched.schedule(lookahead=lambda s: 10)
    assert not out.preempted
    assert [s for s, _ in out.scheduled] == [filler, a, b, waiting]
    bm.check_invariants()


def test_partial_grants_by_budget_and_by_blocks() -> None:
    # By budget: 6 tokens left after two mandatory ones.
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = start_decodes(sched, [5, 5])
    out = sched.schedule(lookahead=lambda s: 5)
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert out.lookahead == {a.seq_id: 5, b.seq_id: 1}

    # By blocks: after the mandatory block, 2 spare blocks above the watermark cover slots 9..19.
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    (c,) = start_decodes(sched, [8])
    out = sched.schedule(lookahead=lambda s: 20)
    assert out.lookahead == {c.seq_id: 11}
    assert len(c.block_table) == 5 and bm.num_free_blocks == sched.watermark_blocks

    # Asking for nothing, or having no spare block and no room in the held block, grants nothing.
    advance(sched, out)  # c: slot 9 is next, in its third block
    out = sched.schedule(lookahead=lambda s: 0)
    assert plan(out) == [(c.seq_id, 1)] and out.lookahead == {}
    bm.check_invariants()


def test_prefills_and_decodes_mixed_budget_is_exact() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=40)
    a, b, p = make_seq(4), make_seq(4), make_seq(30)
    for seq in (a, b, p):
        sched.add(seq)
    advance(sched, sched.schedule(token_budget=18))  # a and b prefilled, p: 10 of 30
    assert (a.num_uncomputed_tokens, b.num_uncomputed_tokens, p.num_uncomputed_tokens) == (1, 1, 20)
    w = make_seq(12)
    sched.add(w)

    # A tight budget shared by its four claimants (15 // 4 = 3 each while others wait): the decodes take
    # one token each, the prefill chunk its share and what the others leave, the waiting prompt is
    # seated with its share, and nobody drafts.
    probe = copy.deepcopy(sched)
    out = probe.schedule(token_budget=15, lookahead=lambda s: 6)
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1), (p.seq_id, 10), (w.seq_id, 3)]  # the copy keeps seq_ids
    assert out.lookahead == {} and not probe.waiting

    asked: list[int] = []
    out = sched.schedule(lookahead=asking(dict.fromkeys((a.seq_id, b.seq_id, p.seq_id, w.seq_id), 6), asked))
    # Shares of 40 // 4 = 10: a 1, b 1, p 10, w 10; what is left goes to the capped ones (p its last 10,
    # w 2 more); drafts come last, from the 6 left: a's.
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1), (p.seq_id, 20), (w.seq_id, 12)]
    assert asked == [a.seq_id]  # a prefill is never asked; b's turn came after the budget ran out
    assert out.lookahead == {a.seq_id: 6}
    assert out.num_tokens + sum(out.lookahead.values()) == 40
    bm.check_invariants()


def test_lookahead_copy_on_write_is_reported_once() -> None:
    """Forks share a block past the decode slot: drafting into it copies it (one spare block per
    copy), and a block made private in pass 1 is not copied again in pass 2."""
    bm = BlockManager(7, 4, enable_prefix_caching=False)  # watermark: 1 block
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    parent = make_seq(6, n=3)
    sched.add(parent)
    out = sched.schedule()
    assert bm.reserve(parent.block_table, 6, 12) == []  # a third block still held from an earlier draft
    advance(sched, out)
    c1, c2 = fork(sched, parent), fork(sched, parent)
    for c in (c1, c2):
        c.token_ids.append(next(_tokens))
    b0, b1, b2 = parent.block_table
    assert [bm.ref_count(x) for x in parent.block_table] == [3, 3, 3] and bm.num_free_blocks == 4

    out = sched.schedule(lookahead=lambda s: 0 if s is c2 else 5)

    assert plan(out) == [(parent.seq_id, 1), (c1.seq_id, 1), (c2.seq_id, 1)]
    # Pass 1 copies block 1 for the first two writers (the last one is left holding it alone), which
    # leaves one spare block: the parent's draft copies block 2 with it; c1 may only draft into
    # its own copy of block 1.
    assert out.lookahead == {parent.seq_id: 5, c1.seq_id: 1}
    assert out.block_copies == [(b1, parent.block_table[1]), (b1, c1.block_table[1]), (b2, parent.block_table[2])]
    assert c1.block_table[2] == b2 and c2.block_table == [b0, b1, b2]
    assert bm.num_free_blocks == sched.watermark_blocks
    bm.check_invariants()


# -- randomized -------------------------------------------------------------------------------------
def test_randomized_invariants_and_no_extra_preemption() -> None:
    """Each step is also scheduled without lookahead from a copy of the same state: pass 1 (who runs,
    how many tokens, who is preempted) must come out identical, so lookahead adds no preemption."""
    rng = random.Random(20240611)
    bm = BlockManager(40, 4)
    sched = Scheduler(bm, max_num_seqs=10, max_num_batched_tokens=48)
    bs, wm = bm.block_size, sched.watermark_blocks
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    seen = dict(granted=0, partial=0, preempted=0, copies=0, starved_decode_steps=0)

    for _ in range(400):
        while rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
            sched.add(make_seq(prompt, n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randint(1, 30)))
        if sched.running and rng.random() < 0.03:
            sched.finish(rng.choice(sched.running))
        want = {s.seq_id: rng.choice([0, 1, 2, 5, 9, 17]) for s in sched.running}
        budget = rng.choice([None, None, rng.randint(1, 48)])
        limit = sched.max_num_batched_tokens if budget is None else budget
        before = [s.seq_id for s in sched.running]
        decodes = [s.seq_id for s in sched.running if s.num_uncomputed_tokens == 1]

        ref = copy.deepcopy(sched).schedule(budget)
        asked: list[int] = []
        out = sched.schedule(budget, lookahead=asking(want, asked))

        # Lookahead changes nothing in pass 1: same sequences, same tokens, same preemptions.
        first = [(sid, n) for sid, n in plan(out) if sid in before]
        assert plan(out)[: len(first)] == first == [(sid, n) for sid, n in plan(ref) if sid in before]
        assert [s.seq_id for s in out.preempted] == [s.seq_id for s in ref.preempted]
        # Budget: mandatory tokens plus every granted slot.
        assert out.num_tokens + sum(out.lookahead.values()) <= limit
        # Only decodes that got their token are asked, in running order, until the budget is spent,
        # and get at most what they asked.
        eligible = [] if out.preempted else [sid for sid in decodes if (sid, 1) in first]
        assert asked == eligible[: len(asked)]
        if len(asked) < len(eligible):
            assert out.num_tokens + sum(out.lookahead.values()) == limit
        assert all(0 < g <= want[sid] and sid in asked for sid, g in out.lookahead.items())
        if out.lookahead:  # nobody drafts while a running sequence (decode or prefill) waits
            assert not out.preempted and set(before) <= {sid for sid, _ in first}
            seen["granted"] += sum(out.lookahead.values())
            seen["partial"] += sum(g < want[sid] for sid, g in out.lookahead.items())
        elif set(decodes) - {sid for sid, _ in first} - {s.seq_id for s in out.preempted}:
            seen["starved_decode_steps"] += 1  # the budget ran out in pass 1: legitimate, no drafts then
        for seq, n in out.scheduled:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n + out.lookahead.get(seq.seq_id, 0)
            if len(seq.block_table) > -(-(seq.num_computed_tokens + 1) // bs) and seq.seq_id in out.lookahead:
                assert bm.num_free_blocks >= wm, "a draft took a new block from the watermark"
        dsts = [dst for _, dst in out.block_copies]
        assert len(set(dsts)) == len(dsts)
        held = {b for seq, _ in out.scheduled for b in seq.block_table}
        assert set(dsts) <= held
        bm.check_invariants()
        seen["preempted"] += len(out.preempted)
        seen["copies"] += len(out.block_copies)

        advance(sched, out, accept=lambda g: rng.randint(0, g))
        for seq, _ in out.scheduled:
            group = seq.group
            # Fork at the first token, unless accepted drafts already went past it (a final prompt
            # token is a one-token step too, so it may draft; the choices could then not share KV).
            first_token = seq.index == 0 and seq.num_output_tokens == 1 and seq.status is SequenceStatus.RUNNING
            if first_token and len(group.seqs) < group.params.n:
                for _ in range(group.params.n - len(group.seqs)):
                    child = fork(sched, seq)
                    child.token_ids.append(rng.randrange(50))
            for s in [seq, *group.seqs[1:]]:
                if s.status is SequenceStatus.RUNNING and s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s)
        bm.check_invariants()

    # The run must have exercised what it checks.
    assert seen["granted"] > 100 and seen["partial"] > 10, seen
    assert seen["preempted"] > 0 and seen["copies"] > 0 and seen["starved_decode_steps"] > 0, seen
