"""Block tables kept as array rows between forwards (PersistentBlockTables) against the padded
tables built from the lists each time, under every way the block manager changes a table."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest

from engine.attention.common import PersistentBlockTables, padded_block_tables
from engine.kv.block_manager import BlockManager
from engine.request.block_table import HISTORY, BlockTable


def test_block_table_says_where_it_changed():
    bt = BlockTable([1, 2, 3])
    v = bt.version
    assert bt.changed_since(v) is None
    bt.append(4)
    assert bt.changed_since(v) == 3
    bt[1] = 9
    assert bt.changed_since(v) == 1 and bt.changed_since(v + 1) == 1
    del bt[2:]
    assert bt.changed_since(v + 2) == 2 and bt == [1, 9]
    bt.extend([])  # no change, no version
    assert bt.changed_since(v + 3) is None
    bt.pop()
    assert bt.changed_since(v + 3) == 1
    for i in range(HISTORY):  # further behind than the history: from 0
        bt.append(i)
    assert bt.changed_since(v) == 0 and bt.changed_since(bt.version - 1) == len(bt) - 1
    bt.clear()
    assert bt.changed_since(bt.version - 1) == 0
    # Copies and pickles are tables of their own with the same blocks.
    bt.extend([5, 6])
    for other in (copy.copy(bt), copy.deepcopy(bt), pickle.loads(pickle.dumps(bt))):
        assert isinstance(other, BlockTable) and other == [5, 6] and other is not bt


def _check(mirror: PersistentBlockTables, tables, block_size: int, rng: random.Random) -> None:
    kv_lens = [rng.randint(1, max(len(t), 1) * block_size) for t in tables]
    got = mirror.rows(tables, kv_lens, block_size)
    want = np.asarray(padded_block_tables([list(t) for t in tables], kv_lens, block_size), dtype=np.int32)
    assert got.dtype == np.int32 and np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_persistent_rows_equal_the_padded_lists_under_the_block_managers_changes(seed):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=400, block_size=bs, enable_prefix_caching=False)
    # Two mirrors (a target's and a draft's runner) reading the same tables at their own cadence.
    mirrors = [PersistentBlockTables(ttl=7), PersistentBlockTables(ttl=5)]
    tables: list[BlockTable] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not tables:  # a new sequence
            t = BlockTable()
            if bm.reserve(t, 0, rng.randint(1, 40)) is not None:
                tables.append(t)
        elif op < 0.45:  # grows (decode, lookahead slots)
            t = rng.choice(tables)
            n = len(t) * bs
            bm.reserve(t, max(n - 1, 0), n + rng.randint(1, 12))
        elif op < 0.65:  # rejected drafts' slots released
            t = rng.choice(tables)
            bm.release_tail(t, [], rng.randint(0, len(t) * bs))
        elif op < 0.75 and len(tables) < 30:  # a fork (n > 1, beams), then a write into the shared tail
            t = rng.choice(tables)
            child = bm.fork(t)
            assert isinstance(child, BlockTable)
            if child and bm.reserve(child, (len(child) - 1) * bs, len(child) * bs) is not None:
                tables.append(child)  # copy-on-write replaced its last block
            else:
                bm.free(child)
        elif op < 0.85:  # finished
            t = tables.pop(rng.randrange(len(tables)))
            bm.free(t)
        batch = rng.sample(tables, k=min(len(tables), rng.randint(1, 8))) if tables else []
        batch = [t for t in batch if t]
        if batch:
            mirror = rng.choice(mirrors)
            # Plain lists (a captured graph's padding sequences) ride along and are converted each time.
            _check(mirror, batch + [[]] * rng.randint(0, 2), bs, rng)
    assert all(len(m.entries) <= 40 for m in mirrors)  # unused tables' rows were given back


def test_metadata_benchmark_compares_both_ways_on_equal_metadata(capsys, monkeypatch):
    """``loadtest.bench_metadata`` checks the kept rows' metadata against the lists' at every step: a
    row left stale fails it rather than timing it."""
    from loadtest import bench_metadata

    assert bench_metadata.main(["--batches", "3x40", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "| sdpa | 3 x 40 |" in out
    monkeypatch.setattr(BlockTable, "changed_since", lambda self, version: None)  # every change ignored
    with pytest.raises(AssertionError, match="kept rows differ"):
        bench_metadata.measure(bench_metadata.builders()["sdpa"], 3, 40, 40)
