"""Unit tests for the KV block manager: pure Python, no torch, no device.

The randomized test simulates the KV pool itself (one token id per slot): the runner's block copies
are applied, every write goes to the slots the manager made writable, and after each operation
every live sequence must read back its own tokens. That catches wrong copy-on-write, a cached
block being overwritten, or a prefix match handing out a block with other content.
"""

from __future__ import annotations

import random

import pytest

from engine.kv import BlockManager

BS = 4  # block size used by most tests


def new_seq(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Admit a sequence the way the scheduler does: match, take the prefix, reserve the rest."""
    prefix, hashes = bm.match_prefix(tokens)
    table: list[int] = []
    block_hashes: list[int] = []
    assert bm.can_allocate(prefix, bm.blocks_needed(len(prefix), len(tokens)))
    bm.take_prefix(table, block_hashes, prefix, hashes)
    copies = bm.reserve(table, len(prefix) * bm.block_size, len(tokens))
    assert copies == []
    return table, block_hashes


# -- allocation, ref counts ---------------------------------------------------------------------------
def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_reserve_then_free_restores_free_count() -> None:
    bm = BlockManager(10, BS)
    table: list[int] = []
    assert bm.reserve(table, 0, 9) == []
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    assert all(bm.ref_count(b) == 1 for b in table)
    # Growing within the last block needs nothing; crossing into the next needs one block.
    assert bm.reserve(table, 9, 12) == [] and len(table) == 3
    assert bm.reserve(table, 12, 13) == [] and len(table) == 4
    bm.free(table)
    assert table == []
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    bm.check_invariants()


def test_blocks_needed() -> None:
    bm = BlockManager(10, BS)
    assert bm.blocks_needed(0, 0) == 0
    assert bm.blocks_needed(0, 1) == 1
    assert bm.blocks_needed(0, 8) == 2
    assert bm.blocks_needed(1, 9) == 2
    assert bm.blocks_needed(3, 9) == 0


def test_fork_and_free_ref_counts() -> None:
    bm = BlockManager(8, BS)
    parent: list[int] = []
    bm.reserve(parent, 0, 10)
    child = bm.fork(parent)
    grandchild = bm.fork(child)
    assert child == parent == grandchild and child is not parent
    assert [bm.ref_count(b) for b in parent] == [3, 3, 3]
    assert bm.num_free_blocks == 5
    bm.free(child)
    assert [bm.ref_count(b) for b in parent] == [2, 2, 2]
    bm.free(parent)
    assert [bm.ref_count(b) for b in grandchild] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    bm.free(grandchild)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_double_free_raises() -> None:
    bm = BlockManager(4, BS)
    table: list[int] = []
    bm.reserve(table, 0, 5)
    stale = list(table)
    bm.free(table)
    with pytest.raises(ValueError, match="double free"):
        bm.free(stale)
    with pytest.raises(ValueError):
        bm.fork(stale)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_reserve_is_atomic_when_short() -> None:
    bm = BlockManager(4, BS)
    a: list[int] = []
    assert bm.reserve(a, 0, 12) == []  # 3 blocks, 1 left
    b: list[int] = []
    assert bm.reserve(b, 0, 8) is None  # needs 2
    assert b == [] and bm.num_free_blocks == 1

    # Copy-on-write plus growth: the shared last block needs a copy and the range needs a new
    # block, 2 in all, with 1 free.
    child = bm.fork(a)
    refs = [bm.ref_count(x) for x in range(4)]
    assert bm.reserve(child, 10, 13) is None
    assert child == a and [bm.ref_count(x) for x in range(4)] == refs and bm.num_free_blocks == 1
    assert bm.can_allocate([], 1) and not bm.can_allocate([], 2)
    bm.check_invariants()


# -- copy-on-write ------------------------------------------------------------------------------------
def test_copy_on_write_of_partial_last_block() -> None:
    bm = BlockManager(8, BS)
    parent: list[int] = []
    bm.reserve(parent, 0, 6)  # block 0 full, block 1 holds 2 of 4 slots
    parent_before = list(parent)
    child = bm.fork(parent)

    copies = bm.reserve(child, 6, 7)  # the child's next token lands in the shared block 1
    assert copies is not None and len(copies) == 1
    src, dst = copies[0]
    assert src == parent[1] and dst == child[1] and dst not in parent
    assert child[0] == parent[0]  # differs only in the written block
    assert parent == parent_before
    assert bm.ref_count(parent[0]) == 2
    assert bm.ref_count(parent[1]) == 1 and bm.ref_count(dst) == 1
    assert bm.num_free_blocks == 5

    # The parent now holds block 1 alone: writing into it needs no copy.
    assert bm.reserve(parent, 6, 7) == []
    assert parent == parent_before
    bm.check_invariants()


def test_no_copy_outside_the_written_range() -> None:
    bm = BlockManager(8, BS)
    parent: list[int] = []
    bm.reserve(parent, 0, 8)  # two full blocks
    child = bm.fork(parent)
    # Writing slots [8, 10) touches only a new block: the shared full blocks stay shared.
    assert bm.reserve(child, 8, 10) == []
    assert child[:2] == parent and len(child) == 3
    assert [bm.ref_count(b) for b in parent] == [2, 2]
    # Rewriting slot 5 (block 1) does copy, and only that block.
    copies = bm.reserve(child, 5, 6)
    assert copies == [(parent[1], child[1])]
    assert child[0] == parent[0] and bm.ref_count(parent[0]) == 2
    bm.check_invariants()


# -- prefix caching -----------------------------------------------------------------------------------
def test_prefix_reused_after_free() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, len(tokens))
    assert len(hashes) == 3  # the partial block is not hashed
    first_blocks = table[:3]
    bm.free(table)
    assert bm.num_free_blocks == 16

    # Same first 2 blocks, then different.
    other = tokens[:8] + [7, 7, 7, 7, 7]
    prefix, prefix_hashes = bm.match_prefix(other)
    assert prefix == first_blocks[:2] and prefix_hashes == hashes[:2]
    assert bm.num_free_blocks == 16  # matching has no side effects
    assert bm.can_allocate(prefix, bm.blocks_needed(2, len(other)))

    table2: list[int] = []
    hashes2: list[int] = []
    bm.take_prefix(table2, hashes2, prefix, prefix_hashes)
    assert table2 == prefix and hashes2 == prefix_hashes
    assert bm.num_free_blocks == 14 and all(bm.ref_count(b) == 1 for b in prefix)
    assert bm.reserve(table2, 8, len(other)) == []
    bm.commit(table2, hashes2, other, len(other))
    assert hashes2[:2] == hashes[:2] and hashes2[2] != hashes[2]
    # Each admission could have matched 3 blocks (13 and 12 of their tokens); 0 and then 2 did.
    assert bm.prefix_cache_stats == (6, 2)

    # A third sequence matching a prefix held by a live table shares it (ref 2).
    prefix3, _ = bm.match_prefix(tokens[:8] + [1])
    assert prefix3 == prefix
    assert bm.can_allocate(prefix3, 1)  # in-use blocks cost nothing
    bm.check_invariants()


def test_match_stops_at_divergence_within_a_block() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(16))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 16)
    diverged = tokens[:6] + [99] + tokens[7:]  # differs in block 1
    assert bm.match_prefix(diverged)[0] == table[:1]
    # The same block contents under a different prefix do not match (hash chain).
    shifted = [99] * 4 + tokens[4:]
    assert bm.match_prefix(shifted)[0] == []


def test_len_minus_one_rule() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(8))  # exactly two blocks
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 8)
    assert len(hashes) == 2
    assert bm.match_prefix(tokens)[0] == table[:1]  # the last token must be computed
    assert bm.match_prefix(tokens + [0])[0] == table
    assert bm.match_prefix(tokens[:1]) == ([], [])
    assert bm.match_prefix([]) == ([], [])


def test_commit_only_hashes_final_full_blocks() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(11))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 7)  # 1 full block of final tokens
    assert len(hashes) == 1
    bm.commit(table, hashes, tokens, 7)  # idempotent
    assert len(hashes) == 1
    bm.commit(table, hashes, tokens, 11)
    assert len(hashes) == 2
    assert bm.match_prefix(tokens + [0])[0] == table[:2]


def test_take_prefix_rejects_evicted_match() -> None:
    bm = BlockManager(2, BS)
    tokens = list(range(5))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 5)
    bm.free(table)
    prefix, prefix_hashes = bm.match_prefix(tokens)
    assert len(prefix) == 1
    other: list[int] = []
    bm.reserve(other, 0, 8)  # takes both blocks, evicting the match
    with pytest.raises(ValueError):
        bm.take_prefix([], [], prefix, prefix_hashes)


def test_eviction_reuses_cached_block() -> None:
    bm = BlockManager(6, BS)
    tokens = list(range(9))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 9)
    cached = table[:2]
    bm.free(table)
    assert bm.match_prefix(tokens)[0] == cached

    # Uncached free blocks are reused before cached ones.
    filler: list[int] = []
    bm.reserve(filler, 0, 4 * BS)
    assert not set(filler) & set(cached)
    assert bm.match_prefix(tokens)[0] == cached

    # Of the cached ones, the sequence's tail went back to the pool first, so it goes first.
    bm.reserve(filler, 4 * BS, 5 * BS)
    assert filler[-1] == cached[1]
    assert bm.match_prefix(tokens)[0] == cached[:1]
    bm.reserve(filler, 5 * BS, 6 * BS)
    assert bm.match_prefix(tokens) == ([], [])
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_duplicate_content_first_wins() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(9))
    a: list[int] = []
    b: list[int] = []
    ha: list[int] = []
    hb: list[int] = []
    bm.reserve(a, 0, 9)
    bm.reserve(b, 0, 9)  # computed independently: same content, different blocks
    bm.commit(a, ha, tokens, 9)
    bm.commit(b, hb, tokens, 9)
    assert ha == hb and len(hb) == 2
    a_blocks = list(a)
    assert bm.match_prefix(tokens)[0] == a_blocks[:2]
    bm.free(a)
    assert bm.match_prefix(tokens)[0] == a_blocks[:2]  # still a's blocks, now at ref 0
    # b is intact and keeps working.
    assert all(bm.ref_count(x) == 1 for x in b)
    assert bm.reserve(b, 9, 13) == []
    bm.commit(b, hb, tokens + [9, 10, 11, 12], 13)
    assert len(hb) == 3
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_release_tail() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 10)
    # A speculative step: reserve 6 draft slots, accept 1.
    assert bm.reserve(table, 10, 16) == []
    assert len(table) == 4 and bm.num_free_blocks == 12
    kept = table[:3]
    dropped = table[3]
    bm.release_tail(table, hashes, 11)
    assert table == kept and bm.ref_count(dropped) == 0
    assert bm.num_free_blocks == 13 and len(hashes) == 2

    # Down to exactly 2 blocks, then to 5 tokens: the second block stays (partially), hashes
    # cover only full blocks.
    bm.release_tail(table, hashes, 8)
    assert table == kept[:2] and len(hashes) == 2
    bm.release_tail(table, hashes, 5)
    assert table == kept[:2] and len(hashes) == 1
    # Growing past the length is a no-op here (reserve does growth).
    bm.release_tail(table, hashes, 100)
    assert table == kept[:2]
    bm.release_tail(table, hashes, 0)
    assert table == [] and hashes == []
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_release_tail_on_a_long_table_touches_only_the_tail() -> None:
    n = 20_000
    bm = BlockManager(n + 8, 1)
    table: list[int] = []
    bm.reserve(table, 0, n)
    head = table[:10]
    for step in range(200):  # shrink one slot at a time
        bm.release_tail(table, [], n - 1 - step)
    assert len(table) == n - 200 and table[:10] == head
    assert bm.num_free_blocks == 208


def test_release_tail_uncaches_a_partially_kept_cached_block() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(9))
    table, hashes = new_seq(bm, tokens)
    bm.commit(table, hashes, tokens, 9)
    # Roll back into block 1 (misuse: those tokens were final). Its slots will be rewritten with
    # other tokens, so it must stop matching.
    bm.release_tail(table, hashes, 6)
    assert len(table) == 2 and len(hashes) == 1
    assert bm.match_prefix(tokens)[0] == table[:1]
    assert bm.reserve(table, 6, 8) == []
    bm.check_invariants()


def test_reset_prefix_cache_forgets_only_free_blocks() -> None:
    bm = BlockManager(8, BS)
    t1, t2 = list(range(5)), list(range(50, 55))
    a, ha = new_seq(bm, t1)
    b, hb = new_seq(bm, t2)
    bm.commit(a, ha, t1, 5)
    bm.commit(b, hb, t2, 5)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(t1) == ([], [])
    assert bm.match_prefix(t2)[0] == b[:1]
    bm.check_invariants()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    table: list[int] = []
    hashes: list[int] = []
    bm.reserve(table, 0, 9)
    bm.commit(table, hashes, tokens, 9)
    assert hashes == []
    bm.free(table)
    assert bm.match_prefix(tokens) == ([], [])
    bm.take_prefix(table, hashes, [], [])
    assert bm.prefix_cache_stats == (0, 0)


# -- randomized ---------------------------------------------------------------------------------------
class _Seq:
    def __init__(self, tokens: list[int], table: list[int], hashes: list[int]) -> None:
        self.tokens = tokens  # every token here has its KV written
        self.table = table
        self.hashes = hashes


def test_randomized_invariants() -> None:
    rng = random.Random(1234)
    num_blocks, bs = 48, 3
    bm = BlockManager(num_blocks, bs)
    kv: list[list[int | None]] = [[None] * bs for _ in range(num_blocks)]  # simulated pool
    live: list[_Seq] = []
    bases = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    seen = {"copies": 0, "reserve_none": 0, "admit_refused": 0}

    def write(seq: _Seq, start: int, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:  # the runner copies before the forward pass writes
            kv[dst] = list(kv[src])
        for pos in range(start, len(seq.tokens)):
            block = seq.table[pos // bs]
            assert bm.ref_count(block) == 1, "writing into a shared block"
            kv[block][pos % bs] = seq.tokens[pos]

    def check() -> None:
        bm.check_invariants()
        refs = [0] * num_blocks
        for seq in live:
            assert len(seq.table) == -(-len(seq.tokens) // bs)
            assert len(set(seq.table)) == len(seq.table)
            assert len(seq.hashes) <= len(seq.tokens) // bs
            for block in seq.table:
                refs[block] += 1
            for pos, tok in enumerate(seq.tokens):
                assert kv[seq.table[pos // bs]][pos % bs] == tok, "sequence reads back wrong KV"
        assert refs == [bm.ref_count(b) for b in range(num_blocks)]
        assert bm.num_free_blocks == refs.count(0)

    for _ in range(2000):
        op = rng.random()
        if op < 0.25 or not live:  # admit a sequence, often sharing a base prefix
            base = rng.choice(bases)
            suffix = [rng.randrange(5) for _ in range(rng.randrange(4))]
            tokens = base[: rng.randrange(1, len(base) + 1)] + suffix
            prefix, prefix_hashes = bm.match_prefix(tokens)
            needed = bm.blocks_needed(len(prefix), len(tokens))
            if not bm.can_allocate(prefix, needed):
                seen["admit_refused"] += 1
                continue
            seq = _Seq(tokens, [], [])
            bm.take_prefix(seq.table, seq.hashes, prefix, prefix_hashes)
            start = len(prefix) * bs
            copies = bm.reserve(seq.table, start, len(tokens))
            assert copies == [], "can_allocate said yes, reserve must succeed without copies"
            live.append(seq)
            write(seq, start, copies)
            bm.commit(seq.table, seq.hashes, seq.tokens, len(seq.tokens))
        elif op < 0.55:  # speculative step: reserve drafts, accept some, release the rest
            seq = rng.choice(live)
            n = len(seq.tokens)
            drafts = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            before = (list(seq.table), bm.num_free_blocks)
            copies = bm.reserve(seq.table, n, n + len(drafts))
            if copies is None:
                seen["reserve_none"] += 1
                assert (seq.table, bm.num_free_blocks) == before
                continue
            seen["copies"] += len(copies)
            seq.tokens.extend(drafts)
            write(seq, n, copies)
            accepted = n + rng.randrange(len(drafts) + 1)
            del seq.tokens[accepted:]
            bm.release_tail(seq.table, seq.hashes, accepted)
            bm.commit(seq.table, seq.hashes, seq.tokens, accepted)
        elif op < 0.7:  # fork
            parent = rng.choice(live)
            live.append(_Seq(list(parent.tokens), bm.fork(parent.table), list(parent.hashes)))
        elif op < 0.78:  # roll back (misuse of final tokens, must stay safe)
            seq = rng.choice(live)
            keep = rng.randrange(1, len(seq.tokens) + 1)
            del seq.tokens[keep:]
            bm.release_tail(seq.table, seq.hashes, keep)
        elif op < 0.99:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq.table)
            assert seq.table == []
        else:
            bm.reset_prefix_cache()
        check()

    hits = bm.prefix_cache_stats[1]
    assert hits > 0 and seen["copies"] > 0 and seen["reserve_none"] > 0 and seen["admit_refused"] > 0, seen
    for seq in live:
        bm.free(seq.table)
    live.clear()
    check()
    assert bm.num_free_blocks == num_blocks and bm.usage == 0.0
