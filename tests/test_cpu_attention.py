"""The C++ CPU kernel of ``augur::paged_attention`` against the op's Python implementation (the reference).

Both paths are checked: the fused one (up to 32 new tokens per sequence: decodes, draft levels, verify
trees) and the gathered one (longer prefill chunks), with GQA, tree masks over earlier levels, sliding
windows, soft-capping, bf16, and K/V that arrive as strided views of a fused QKV projection.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.attention.cpu_kernel import load_cpu_kernel
from engine.attention.sdpa import _paged_attention_impl, build_sdpa_metadata


@pytest.fixture(autouse=True, scope="module")
def kernel():
    # CI has the compiler and ninja: a failed build must fail here, not leave the reference comparing
    # with itself.
    assert load_cpu_kernel()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("augur::paged_attention", "CPU")


def batch(seed: int, q_lens: list[int], H: int, Hkv: int, D: int, dtype, trees: bool, window: int | None):
    """Sequences with the given new-token counts over a shuffled paged pool (block size 4); with
    ``trees``, every sequence of several new tokens gets a random ancestor mask that reaches back over
    up to 3 cached tokens (a tree expanded level by level)."""
    g = torch.Generator().manual_seed(seed)
    bs = 4
    ctx = [int(torch.randint(3, 60, (), generator=g)) for _ in q_lens]
    need = [-(-(c + q) // bs) for c, q in zip(ctx, q_lens)]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    masks, starts = [], []
    for c, q in zip(ctx, q_lens):
        if trees and q > 1:
            start = c - int(torch.randint(0, 4, (), generator=g))
            m = torch.rand(q, c + q - start, generator=g) < 0.5
            m[:, c - start :] &= torch.ones(q, q, dtype=torch.bool).tril()
            m[torch.arange(q), c - start + torch.arange(q)] = True  # each node sees itself
            masks.append(m)
            starts.append(start)
        else:
            masks.append(None)
            starts.append(c)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens)])
    meta = build_sdpa_metadata(
        q_lens, ctx, tables, bs, positions, masks if trees else None, starts, sliding_window=window
    )  # fmt: skip
    T, slots = sum(q_lens), (sum(need) + 3) * bs
    pool = torch.randn(2, 2, slots, Hkv, D, generator=g).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)  # K and V as the model passes them: views
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return meta, pool, q.reshape(T, H, D) * 2, k.view(T, Hkv, D), v.unflatten(-1, (Hkv, D))


def both(meta, pool, q, k, v, window, softcap, sinks=None, op=None):
    """(reference output, pool) and (kernel output, pool), layer 1 of a two-layer pool."""
    mask = meta.sliding_mask if window is not None else meta.mask
    args = (1, meta.slot_mapping, meta.kv_slots, mask, meta.q_index, q.shape[-1] ** -0.5, softcap, sinks)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = _paged_attention_impl(q, k, v, ref_pool, *args)
    got = (op or torch.ops.augur.paged_attention)(q, k, v, got_pool, *args)
    return (ref, ref_pool), (got, got_pool)


SHAPES = {"mha": (4, 4, 16), "gqa2": (4, 2, 64), "gqa3": (3, 1, 32), "gqa4": (8, 2, 24), "gqa4-d128": (8, 2, 128)}
BATCHES = {
    "decodes": [1, 1, 1, 1],
    "one": [1],
    "trees": [5, 1, 12, 3],
    "widest fused": [32, 1],
    "gathered": [33, 1, 4],
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("lens", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(shape, lens, dtype):
    H, Hkv, D = SHAPES[shape]
    q_lens = BATCHES[lens]
    seed = sum(q_lens) * 31 + H * 7 + D
    meta, pool, q, k, v = batch(seed, q_lens, H, Hkv, D, dtype, trees=True, window=None)
    (ref, ref_pool), (got, got_pool) = both(meta, pool, q, k, v, None, 0.0)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)  # the new K/V, at their slots
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("lens", ["trees", "gathered"])
def test_kernel_sliding_window_and_softcap(window, softcap, lens):
    meta, pool, q, k, v = batch(11, BATCHES[lens], 4, 2, 16, torch.float32, trees=window is None, window=window)
    (ref, _), (got, _) = both(meta, pool, q, k, v, window, softcap)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if softcap and window != 1:  # (a window of 1 leaves one key per query: nothing for the cap to change)
        (uncapped, _), _ = both(meta, pool, q, k, v, window, 0.0)
        assert (uncapped - ref).abs().max() > 1e-2  # the cap bit


@pytest.mark.parametrize("lens", ["decodes", "trees", "gathered"])
@pytest.mark.parametrize("rows", [False, True], ids=["paged_attention", "paged_attention_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_sinks(lens, rows, dtype):
    """gpt-oss's sinks (a logit per query head in each softmax, with no value), on both the kernel's
    paths and both ops, against the reference; and the reference against attention by hand: the
    weights are the sink-less softmax's times sigmoid(logsumexp(scores) - sink)."""
    H, Hkv, D = 4, 2, 64
    window = 6 if lens == "decodes" else None
    meta, pool, q, k, v = batch(13, BATCHES[lens], H, Hkv, D, dtype, trees=True, window=window)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0])  # the last takes nearly all of its head's weight
    op = torch.ops.augur.paged_attention_rows if rows else torch.ops.augur.paged_attention
    (ref, ref_pool), (got, got_pool) = both(meta, pool, q, k, v, window, 0.0, sinks, op)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    (plain, _), _ = both(meta, pool, q, k, v, window, 0.0)
    assert (plain.float() - ref.float()).abs().max() > 0.1  # the sinks bit
    # By hand, for the first token: its keys, scores and the sink's share.
    mask = (meta.sliding_mask if window else meta.mask)[0, 0, int(meta.q_index[0])]
    slots = meta.kv_slots[0][mask]
    keys, values = ref_pool[1, 0, slots].float(), ref_pool[1, 1, slots].float()
    for h in range(H):
        scores = keys[:, h // (H // Hkv)] @ q[0, h].float() * D**-0.5
        keep = torch.sigmoid(torch.logsumexp(scores, 0) - sinks[h])
        want = keep * (torch.softmax(scores, 0) @ values[:, h // (H // Hkv)])
        torch.testing.assert_close(ref[0, h * D : (h + 1) * D].float(), want, atol=tol, rtol=tol)


def test_a_wrong_mask_changes_the_kernel_output():
    """The comparison can fail: a tree mask that hides one visible key moves the kernel's output."""
    meta, pool, q, k, v = batch(5, BATCHES["trees"], 4, 2, 16, torch.float32, trees=True, window=None)
    (ref, _), _ = both(meta, pool, q, k, v, None, 0.0)
    row = int(meta.q_index[0])  # the first token of the first sequence
    visible = meta.mask[0, 0, row].nonzero().flatten()
    meta.mask[0, 0, row, visible[0]] = False
    _, (got, _) = both(meta, pool, q, k, v, None, 0.0)
    assert (got[0] - ref[0]).abs().max() > 1e-4
    torch.testing.assert_close(got[1:], ref[1:], atol=2e-5, rtol=2e-5)


def test_a_stale_build_lock_is_cleared_and_a_live_one_kept(tmp_path, monkeypatch):
    """A process killed while building leaves torch's build lock behind, and every later load would
    wait for it forever; a lock older than any build is removed, a recent one is left to its builder."""
    import os
    import time

    from engine.attention import cpu_kernel

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "STALE_LOCK_SECONDS", 3)
    (tmp_path / "old").mkdir()
    lock = tmp_path / "old" / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    cpu_kernel._clear_stale_lock("old")
    assert not lock.exists()
    # A live builder's lock: waited for while it may be building, removed once it has outlived that.
    (tmp_path / "live").mkdir()
    lock = tmp_path / "live" / "lock"
    lock.touch()
    cpu_kernel._clear_stale_lock("live")  # returns (the lock gone) instead of waiting forever
    assert not lock.exists()


@pytest.mark.parametrize("seed", range(4))
def test_decode_metadata_matches_the_general_build(seed):
    """A batch of one new token a sequence takes a shorter build: every tensor, and the mask's layout
    (a compiled forward guards on it), equal the general build's."""
    g = torch.Generator().manual_seed(seed)
    B, block = 1 + seed * 3, 4
    ctx = torch.randint(0, 40, (B,), generator=g).tolist()
    tables = [torch.randperm(64, generator=g)[: c // block + 1].tolist() for c in ctx]
    common = dict(q_lens=[1] * B, ctx_lens=ctx, block_tables=tables, block_size=block, positions=torch.tensor(ctx))
    fast = build_sdpa_metadata(**common)
    general = build_sdpa_metadata(**common, new_token_masks=[None] * B)  # no mask given: the general path
    for name in ("slot_mapping", "kv_slots", "mask", "q_index"):
        a, b = getattr(fast, name), getattr(general, name)
        assert torch.equal(a, b), name
        assert a.stride() == b.stride(), name
    assert fast.mask._base.stride() == general.mask._base.stride()
    assert (fast.num_seqs, fast.max_q, fast.sliding_mask) == (general.num_seqs, general.max_q, None)


def test_the_engine_settles_the_import_hooks_before_it_starts_threads():
    """setuptools' first import (through torch.utils.cpp_extension) inserts a finder at the head of
    ``sys.meta_path`` and removes it again; a thread importing meanwhile can skip the path finder and
    fail with "No module named ...". The engine's modules import it up front, in the importing thread, so
    the kernel builds (two threads) and inductor's C++ builder (the compile thread) never change the list."""
    probe = """
import sys

import engine.core.llm_engine  # what every front imports before it starts a thread

class Watched(list):
    changes = []
    def insert(self, i, x):
        self.changes.append(("insert", x)); super().insert(i, x)
    def remove(self, x):
        self.changes.append(("remove", x)); super().remove(x)

sys.meta_path = Watched(sys.meta_path)
import torch.utils.cpp_extension
import torch._inductor.cpp_builder
import setuptools
print(len(Watched.changes))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]
