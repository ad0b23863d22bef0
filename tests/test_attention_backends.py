"""Attention backends against the SDPA reference, and the memory of one mixed step at the 8B preset.

Without CUDA the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest), on CPU tensors; with CUDA the same tests run the compiled kernel on the GPU.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from test_engine import make_engine, prompts
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import build_model_dir
from engine.attention import metadata_builder, paged_attention, resolve_backend
from engine.attention.sdpa import _paged_attention_impl
from engine.config import EngineConfig
from engine.models import model_class_for
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk
from loadtest.bench_gpu import model_config

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip("Triton's interpreter runs this kernel from version 3.9 on", allow_module_level=True)


# -- one forward's inputs ---------------------------------------------------------------------------
def random_batch(seed: int, kinds: list[str], H: int, Hkv: int, D: int, block_size: int, dtype=torch.float32):
    """Sequences of the given kinds in one flat batch, over a shuffled paged pool:

    - ``decode``: one new token after up to 70 cached ones;
    - ``chunk``: a prefill chunk of 2-40 tokens (several kernel programs) after 0-50 cached ones;
    - ``tree``: 3-12 draft nodes with a random ancestor-style mask (each node sees itself) that reaches
      back over up to 6 cached tokens (a tree expanded level by level), positions at or before each
      node's slot.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=g))

    q_lens, ctx_lens, positions, masks, mask_starts = [], [], [], [], []
    for kind in kinds:
        if kind == "decode":
            q, c = 1, rand(0, 70)
        elif kind == "chunk":
            q, c = rand(2, 40), rand(0, 50)
        else:
            q, c = rand(3, 12), rand(6, 40)
        q_lens.append(q)
        ctx_lens.append(c)
        if kind == "tree":
            start = c - rand(0, 6)
            width = c + q - start
            m = torch.rand(q, width, generator=g) < 0.5
            m[torch.arange(q), c - start + torch.arange(q)] = True  # each node sees itself
            m[:, c - start :] &= torch.ones(q, q, dtype=torch.bool).tril()  # and no later node
            masks.append(m)
            mask_starts.append(start)
            positions += [start + rand(0, c - start + i) for i in range(q)]
        else:
            masks.append(None)
            mask_starts.append(c)
            positions += range(c, c + q)

    need = [-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens)]
    num_blocks = sum(need) + 2 * len(kinds) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in need:  # a table may hold more blocks than the forward needs (reserved lookahead)
        extra = rand(0, 2)
        tables.append(perm[: n + extra])
        perm = perm[n + extra :]
    T = sum(q_lens)
    pool = torch.randn(1, 2, num_blocks * block_size, Hkv, D, generator=g).to(dtype)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    lists = dict(
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        block_tables=tables,
        block_size=block_size,
        new_token_masks=masks if any(m is not None for m in masks) else None,
        mask_starts=mask_starts,
    )
    return lists, torch.tensor(positions), pool, q, k, v


def attend_both(lists, positions, pool, q, k, v, window, softcap, sliding, sinks=None, **triton_args):
    """(reference output, pool) and (triton output, pool) for the same inputs."""
    results = []
    for name, extra in (("sdpa", {}), ("triton", triton_args)):
        p = pool.to(DEVICE)
        meta = metadata_builder(name)(
            **lists, positions=positions.to(DEVICE), sliding_window=window, device=DEVICE, **extra
        )  # fmt: skip
        D = q.shape[-1]
        args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), p, 0)
        if name == "sdpa":  # the op's Python implementation, whichever kernel serves CPU tensors
            mask = meta.sliding_mask if sliding else meta.mask
            out = _paged_attention_impl(
                *args, meta.slot_mapping, meta.kv_slots, mask, meta.q_index, D**-0.5, softcap, sinks
            )  # fmt: skip
        else:
            out = paged_attention(*args, meta, D**-0.5, sliding=sliding, softcap=softcap, sinks=sinks)
        results.append((out.float().cpu(), p.float().cpu()))
    return results


KINDS = {
    "decodes": ["decode", "decode", "decode"],
    "mixed": ["decode", "chunk", "tree", "decode", "chunk"],
    "trees": ["tree", "tree", "decode"],
}


@pytest.mark.parametrize(
    "H,Hkv,D",
    [(4, 4, 16), (4, 2, 32), (8, 2, 24), (7, 1, 16)],
    ids=["mha", "gqa2", "gqa4-d24", "gqa7"],
)
@pytest.mark.parametrize("block_size", [4, 3, 16])
@pytest.mark.parametrize("kinds", list(KINDS))
def test_triton_matches_reference(H, Hkv, D, block_size, kinds):
    """Decode-only batches (one program per sequence), and mixed batches of prefill chunks, trees
    and decodes across block boundaries: outputs and the written K/V equal the reference's."""
    seed = 1000 * H + 100 * Hkv + D + 7 * block_size + len(kinds)
    lists, positions, pool, q, k, v = random_batch(seed, KINDS[kinds], H, Hkv, D, block_size)
    (ref, ref_pool), (got, got_pool) = attend_both(lists, positions, pool, q, k, v, None, 0.0, False)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 1, 5, 17])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_triton_sliding_window_and_softcap(window, softcap):
    """Sliding layers (windows shorter than the chunks, tiles skipped before them) and soft-capped
    scores (a cap low enough to bite on unit-normal q and k)."""
    lists, positions, pool, q, k, v = random_batch(7, KINDS["mixed"] + ["tree"], 8, 2, 16, 4)
    sliding = window is not None
    (ref, _), (got, _) = attend_both(lists, positions, pool, q * 3, k, v, window, softcap, sliding)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if softcap:
        (uncapped, _), _ = attend_both(lists, positions, pool, q * 3, k, v, window, 0.0, sliding)
        assert (uncapped - ref).abs().max() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (9, 0.0), (None, 2.0)])
@pytest.mark.parametrize("kinds", [["decode"] * 4, ["tree", "chunk", "decode", "tree"]], ids=["decodes", "verifies"])
def test_triton_split_keys(splits, window, softcap, kinds):
    """Batches with each program's keys split into ranges (flash-decoding) and combined, decodes and
    the verify batches of drafts (trees, chains, short chunks: several rows a program, causal rows
    whose keys end inside a range): the reference's output, with ranges that end up empty (more splits
    than key tiles, past a causal row's last key, or before the sliding window) weighing nothing."""
    lists, positions, pool, q, k, v = random_batch(splits, kinds, 8, 2, 16, 4)
    # Move sequence i 130 * i tokens further into its context (up to 8 key tiles), on its own blocks.
    shift = [130 * i for i in range(len(kinds))]
    seq_of_tok = torch.repeat_interleave(torch.arange(len(kinds)), torch.tensor(lists["q_lens"]))
    positions = positions + torch.tensor(shift)[seq_of_tok]
    lists["ctx_lens"] = [c + s for c, s in zip(lists["ctx_lens"], shift)]
    lists["mask_starts"] = [m + s for m, s in zip(lists["mask_starts"], shift)]
    lists["block_tables"] = [list(range(i * 150, (i + 1) * 150)) for i in range(len(kinds))]
    pool = torch.randn(1, 2, 150 * 4 * len(kinds), 2, 16, generator=torch.Generator().manual_seed(splits))
    args = (lists, positions, pool, q * 3, k, v, window, softcap, window is not None)
    (ref, ref_pool), (got, got_pool) = attend_both(*args, num_splits=splits)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_triton_attention_sinks(splits, window):
    """gpt-oss's sinks (a logit per query head in each softmax, with no value), in one key range and
    in split ranges combined, against the reference; the sinks change the output."""
    lists, positions, pool, q, k, v = random_batch(21, KINDS["mixed"] + ["tree"], 8, 2, 16, 4)
    sinks = torch.linspace(-2.0, 6.0, 8, device=DEVICE)
    args = (lists, positions, pool, q * 3, k, v, window, 0.0, window is not None)
    (ref, _), (got, _) = attend_both(*args, sinks=sinks, num_splits=splits)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    (plain, _), _ = attend_both(*args)
    assert (plain - ref).abs().max() > 1e-2


def test_triton_bfloat16():
    lists, positions, pool, q, k, v = random_batch(3, KINDS["mixed"], 8, 2, 32, 16, dtype=torch.bfloat16)
    (ref, _), (got, _) = attend_both(lists, positions, pool, q, k, v, None, 0.0, False)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_tree_mask_of_the_wrong_shape_is_refused():
    lists, positions, *_ = random_batch(1, ["tree"], 4, 2, 16, 4)
    lists["new_token_masks"][0] = lists["new_token_masks"][0][:, 1:]
    with pytest.raises(ValueError, match="tree mask shape"):
        metadata_builder("triton")(**lists, positions=positions)


# -- choosing a backend -----------------------------------------------------------------------------
def test_backend_resolution(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("sdpa", torch.device("cpu")) == "sdpa"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (conftest sets it on machines without CUDA)
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # interpreted
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention backend must be"):
        resolve_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend must be"):
        EngineConfig(model="m", attention_backend="flash")


# -- whole engines ----------------------------------------------------------------------------------
def test_engine_on_triton_decodes_like_the_reference(llama_dir, tmp_path, tokenizer_dir):
    """Greedy speculative decoding (draft trees verified with their masks, chunked prefill, shared
    prefixes) on the Triton backend gives the tokens plain decoding on the reference gives."""
    draft = build_model_dir(tmp_path / "draft", tokenizer_dir, "LlamaForCausalLM", seed=5, num_hidden_layers=1)
    ps = prompts(3, seed=4, lo=10, hi=30)
    ps.append(ps[0][:8] + ps[1][:4])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, num_draft_tokens=3)
    plain = make_engine(llama_dir, device=str(DEVICE)).generate(ps, params)
    spec = make_engine(
        llama_dir, device=str(DEVICE), attention_backend="triton", speculative_method="draft", draft_model=str(draft),
        num_speculative_tokens=3, spec_tree_topk=2, max_num_batched_tokens=24,
    )  # fmt: skip
    assert spec.runner.attention_backend == "triton"
    assert spec.proposer.runner.attention_backend == "triton"
    got = spec.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in plain]
    assert spec.spec_stats.num_draft_tokens > 0


def test_sliding_and_softcapped_model_on_triton(tmp_path, tokenizer_dir):
    """Gemma-2 (alternating sliding windows, attention soft-capping): a prefill in two chunks and
    single decodes give the reference's logits."""
    from test_gemma2 import CASES, build_gemma2_dir

    path = build_gemma2_dir(tmp_path / "gemma", tokenizer_dir, **CASES["capped"])
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    logits = {}
    for backend in ("sdpa", "triton"):
        engine = make_engine(path, device=str(DEVICE), attention_backend=backend)
        table = engine.block_manager.fork([]) or []
        assert engine.block_manager.reserve(table, 0, len(ids)) is not None
        run = engine.runner.forward
        got = [run([ForwardChunk(ids[:11], 0, table, 11)]).logits, run([ForwardChunk(ids[11:20], 11, table, 9)]).logits]
        got += [run([ForwardChunk(ids[t : t + 1], t, table, 1)]).logits for t in range(20, len(ids))]
        logits[backend] = torch.cat(got).cpu()
    torch.testing.assert_close(logits["triton"], logits["sdpa"], atol=1e-4, rtol=1e-4)


# -- memory of one mixed step, on shapes only ------------------------------------------------------
class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors that ops allocate while the mode is on (meta tensors included).
    Inputs that existed before are not counted; a storage is freed when no tensor using it is left."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage → bytes, for the storages allocated under the mode
        self.users: dict[int, int] = {}  # storage → live tensors using it
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key not in self.sizes:
                if key in inputs:  # a view or an in-place result of something allocated before
                    continue
                self.sizes[key], self.users[key] = t.untyped_storage().nbytes(), 0
                self.now += self.sizes[key]
                self.peak = max(self.peak, self.now)
            self.users[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            self.now -= self.sizes.pop(key)
            del self.users[key]


def preset_step_peak(backend: str, context: int) -> int:
    """Peak bytes of one forward under the shipped 8B preset (configs/llama-3.1-8b-instruct.yaml: 64
    sequences, a 4096-token step, 16-token blocks): 63 decodes at ``context`` and a prefill chunk
    filling the rest of the budget, with the LM head on the 64 rows that need logits. Everything is
    on the meta device: shapes only, no memory, no compute."""
    seqs, budget, block = 64, 4096, 16
    config = model_config("llama-3.1-8b", max_positions=16384)
    meta_dev = torch.device("meta")
    with meta_dev:
        model = model_class_for(config)(config, 16384).to(torch.bfloat16)
    model.rope_cos = model.rope_sin = torch.empty(16384, 128, device=meta_dev)
    q_lens = [1] * (seqs - 1) + [budget - (seqs - 1)]
    ctx_lens = [context] * (seqs - 1) + [context]
    per_seq = -(-(context + budget) // block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    kv = torch.empty(32, 2, seqs * per_seq * block, 8, 128, dtype=torch.bfloat16, device=meta_dev)
    T = sum(q_lens)
    with torch.inference_mode(), PeakMemory() as mem:
        ids = torch.zeros(T, dtype=torch.int64, device=meta_dev)
        positions = torch.zeros(T, dtype=torch.int64, device=meta_dev)
        meta = metadata_builder(backend)(q_lens, ctx_lens, tables, block, positions, device=meta_dev)
        hidden, _ = model(ids, positions, meta, kv)
        model.compute_logits(hidden[-seqs:])
    return mem.peak


def test_mixed_step_memory_at_the_8b_preset_is_bounded():
    """The Triton backend's step needs well under 1 GiB beyond the weights and the pool (the MLP's
    activations dominate), and nothing that grows with the context but the block tables; the
    reference's dense mask alone is over 4 GiB there, before its scores."""
    short, long = preset_step_peak("triton", 1024), preset_step_peak("triton", 12000)
    assert long < 1 << 30
    assert long - short < 1 << 20  # 64 block tables of ~1000 more int32 entries: 0.25 MiB
    assert preset_step_peak("sdpa", 12000) > 4 << 30


# -- the compiled kernel at real shapes ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (28, 4, 128), (16, 8, 256)], ids=["llama", "qwen", "gemma"])
def test_triton_at_model_shapes_on_gpu(H, Hkv, D):
    lists, positions, pool, q, k, v = random_batch(11, KINDS["mixed"] * 4, H, Hkv, D, 16, dtype=torch.bfloat16)
    (ref, ref_pool), (got, got_pool) = attend_both(lists, positions, pool, q, k, v, 4096, 0.0, False)
    torch.testing.assert_close(got_pool, ref_pool, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
