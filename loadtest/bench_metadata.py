"""Host time of the attention metadata a decode step builds, block tables as Python lists against the
rows the runner keeps (``PersistentBlockTables``): ``python -m loadtest.bench_metadata``.

For each backend and batch (sequences x context), ``--steps`` decode steps: every sequence one token
longer a step and a block appended every ``block_size`` tokens, the metadata built each step from the
lists (the baseline) and from the kept rows, in the same process; prints the median milliseconds a
step of each and their ratio. Both ways' metadata are compared at every step (the block tables the
kernel reads, the slots it writes), so a figure never stands for a wrong table. The triton builder
needs the triton package (its metadata is host work; no GPU is used).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from engine.attention.common import PersistentBlockTables
from engine.request.block_table import BlockTable

BLOCK = 16


def builders() -> dict:
    from engine.attention.sdpa import build_sdpa_metadata

    found = {"sdpa": build_sdpa_metadata}
    if importlib.util.find_spec("triton") is not None:
        from engine.attention.triton_paged import build_triton_metadata

        found["triton"] = build_triton_metadata
    return found


def _same(a, b) -> bool:
    names = ("block_tables", "slot_mapping") if hasattr(a, "block_tables") else ("kv_slots", "slot_mapping")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)


def measure(builder, num_seqs: int, context: int, steps: int) -> tuple[float, float]:
    """Median seconds a step with lists, and with kept rows."""
    tables = [BlockTable(range(i * 4096, i * 4096 + context // BLOCK + 1)) for i in range(num_seqs)]
    ctx = [context] * num_seqs
    rows = PersistentBlockTables()
    lists_s, rows_s = [], []
    for _ in range(steps):
        kv = [c + 1 for c in ctx]
        common = dict(q_lens=[1] * num_seqs, ctx_lens=ctx, block_size=BLOCK, positions=torch.tensor(ctx))
        t0 = time.perf_counter()
        a = builder(block_tables=tables, **common)
        t1 = time.perf_counter()
        b = builder(block_tables=rows.rows(tables, kv, BLOCK), **common)
        t2 = time.perf_counter()
        if not _same(a, b):
            raise AssertionError(f"kept rows differ from the lists at {num_seqs} x {ctx[0]}")
        lists_s.append(t1 - t0)
        rows_s.append(t2 - t1)
        for i, t in enumerate(tables):
            ctx[i] += 1
            if ctx[i] % BLOCK == 0:
                t.append(t[-1] + 1)
    skip = min(steps // 10, 20)  # the first steps fill the rows
    return statistics.median(lists_s[skip:]), statistics.median(rows_s[skip:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", default=["8x300", "64x2000", "64x8000"], help="SEQUENCESxCONTEXT")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    print("| backend | sequences x context | lists (ms/step) | kept rows (ms/step) | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, builder in builders().items():
        for spec in args.batches:
            num_seqs, context = (int(x) for x in spec.split("x"))
            lists_s, rows_s = measure(builder, num_seqs, context, args.steps)
            ratio = lists_s / rows_s
            print(f"| {name} | {num_seqs} x {context} | {lists_s * 1e3:.3f} | {rows_s * 1e3:.3f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
