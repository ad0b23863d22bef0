"""Greedy chains' draft levels in one call (``ModelRunner.prepare_levels`` + ``chain``): the
same tokens and the same K/V as feeding the levels one forward at a time, for sequences of
different lengths across block boundaries, with a sliding window, and compiled."""

from __future__ import annotations

import pytest
import torch

from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

BS = 4  # block size


def runner(path, compiled: bool = False, backend: str = "sdpa") -> ModelRunner:
    cfg = load_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 128, pack=not compiled)
    dev, f32 = torch.device("cpu"), torch.float32
    return ModelRunner(model, cfg, dev, f32, BS, 40, compile=compiled, attention_backend=backend, freeze=False)


def prefill(r: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
    """Cache every prompt but its last token (the root); returns the roots' next-token argmax [B]."""
    r.forward([ForwardChunk(p[:-1], 0, t, 0) for p, t in zip(prompts, tables)])
    out = r.forward([ForwardChunk(p[-1:], len(p) - 1, t, 1) for p, t in zip(prompts, tables)])
    return out.logits.argmax(-1)


def one_at_a_time(r: ModelRunner, prompts, tables, first: torch.Tensor, levels: int) -> torch.Tensor:
    ids, out = first, []
    for d in range(levels):
        chunks = [ForwardChunk([0], len(p) + d, t, 1) for p, t in zip(prompts, tables)]
        ids = r.execute(r.prepare(chunks), input_ids=ids).logits.argmax(-1)
        out.append(ids)
    return torch.stack(out, 1)


def fused(r: ModelRunner, prompts, tables, first: torch.Tensor, levels: int) -> torch.Tensor:
    chunks = [ForwardChunk([0] * levels, len(p), t, levels) for p, t in zip(prompts, tables)]
    return r.chain(r.prepare_levels(chunks), first)[0]


CASES = [  # prompt lengths: one sequence, several ending at different offsets in their blocks
    [7],
    [5, 12, 3],
    [8, 9],
]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM"])  # Mistral: a sliding window
@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("levels", [1, 3, 5])
def test_fused_levels_match_one_forward_per_level(model_dirs, arch, lens, levels):
    check_levels(model_dirs[arch], lens, levels, "sdpa")


def test_fused_levels_on_a_backend_that_builds_each_level(model_dirs):
    """Backends whose metadata has no ``levels()`` (Triton: its kernel in the interpreter here) build
    one metadata per level; the chain is the same."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("Triton's interpreter runs this kernel from version 3.9 on")
    check_levels(model_dirs["LlamaForCausalLM"], [5, 12], 3, "triton")


def check_levels(path, lens: list[int], levels: int, backend: str) -> None:
    g = torch.Generator().manual_seed(sum(lens) + levels)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    # Shuffled, disjoint block tables with room for every level.
    need = [-(-(n + levels) // BS) for n in lens]
    perm = torch.randperm(39, generator=g).add(1).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    a, b = runner(path), runner(path, backend=backend)
    first = prefill(a, prompts, tables)
    assert torch.equal(prefill(b, prompts, tables), first)
    want = one_at_a_time(a, prompts, tables, first, levels)
    got = fused(b, prompts, tables, first, levels)
    assert got.shape == (len(lens), levels)
    assert torch.equal(got, want)
    # Every level wrote its token's K/V to the same slot, with the same values.
    torch.testing.assert_close(b.kv_cache, a.kv_cache, atol=1e-5, rtol=1e-5)


def test_a_wrong_level_view_is_caught(model_dirs):
    """The comparison can fail: levels that each see the whole chunk (no causal cut) give other K/V."""
    path = model_dirs["LlamaForCausalLM"]
    prompts, tables, levels = [[5, 6, 7, 8, 9]], [[3, 4, 5]], 4
    a, b = runner(path), runner(path)
    first = prefill(a, prompts, tables)
    prefill(b, prompts, tables)
    one_at_a_time(a, prompts, tables, first, levels)
    chunks = [ForwardChunk([0] * levels, 5, tables[0], levels)]
    batches = b.prepare_levels(chunks)
    for batch in batches:  # every level sees all the chunk's slots, its later levels' stale K/V too
        batch.meta.mask = batches[-1].meta.mask
    b.kv_cache[:, :, 5 * BS : 6 * BS] = 1.0  # stale values in the slots later levels will write
    b.chain(batches, first)
    assert not torch.allclose(b.kv_cache, a.kv_cache, atol=1e-3)


def test_sampled_levels_match_one_forward_per_level(model_dirs):
    """Sampled chains: with the same noise, each level's token and ``q`` are those of one forward per
    level followed by the same draw."""
    from engine.runner.model_runner import chain_pick

    path, lens, levels = model_dirs["LlamaForCausalLM"], [7, 12], 3
    prompts = [[3 + (i * 5 + j) % 50 for j in range(n)] for i, n in enumerate(lens)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    a, b = runner(path), runner(path)
    first = prefill(a, prompts, tables)
    prefill(b, prompts, tables)
    g = torch.Generator().manual_seed(0)
    temperature = torch.tensor([0.7, 1.3])
    noise = torch.empty(levels, len(lens), a.vocab_size).exponential_(generator=g)
    ids, want_t, want_q = first, [], []
    for d in range(levels):
        chunks = [ForwardChunk([0], len(p) + d, t, 1) for p, t in zip(prompts, tables)]
        ids, q = chain_pick(a.execute(a.prepare(chunks), input_ids=ids).logits, temperature, noise[d])
        want_t.append(ids)
        want_q.append(q)
    chunks = [ForwardChunk([0] * levels, len(p), t, levels) for p, t in zip(prompts, tables)]
    got_t, got_q = b.chain(b.prepare_levels(chunks), first, temperature, noise)
    assert torch.equal(got_t, torch.stack(want_t, 1))
    torch.testing.assert_close(got_q, torch.stack(want_q, 1), atol=1e-6, rtol=1e-5)


def test_sampled_levels_draw_from_the_q_they_return(model_dirs, monkeypatch):
    """Many sequences with one root token: the first fused level's logits are the same for all, so
    its tokens are i.i.d. draws, which must follow the ``q`` returned with them (G-test). Tokens
    drawn at the wrong temperature (``logits * T`` for ``logits / T``) are caught."""
    from test_spec import g_statistic, g_test_threshold

    import engine.runner.model_runner as runner_mod

    path = model_dirs["LlamaForCausalLM"]
    B, rounds, T = 64, 48, 0.8
    prompt = [5, 9, 13, 17, 21]
    tables = [[2 * i, 2 * i + 1] for i in range(B)]  # 8 slots each: the prompt and two levels
    r = runner(path)
    r.allocate_kv(2 * B)
    first = prefill(r, [prompt] * B, tables)
    chunks = [ForwardChunk([0, 0], len(prompt), t, 2) for t in tables]
    temperature = torch.full((B,), T)

    def sample(seed: int) -> tuple[dict, dict, int]:
        g = torch.Generator().manual_seed(seed)
        counts: dict = {}
        for _ in range(rounds):
            noise = torch.empty(2, B, r.vocab_size).exponential_(generator=g)
            tokens, q = r.chain(r.prepare_levels(chunks), first, temperature, noise)
            for t in tokens[:, 0].tolist():
                counts[(t,)] = counts.get((t,), 0) + 1
        return counts, {(v,): p for v, p in enumerate(q[0, 0].tolist())}, B * rounds

    counts, expected, n = sample(1)
    stat, dof = g_statistic(counts, expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    pick = runner_mod.chain_pick

    def wrong_q(logits, temperature=None, noise=None):  # the tokens drawn from softmax(logits * T)
        return pick(logits * temperature[:, None] ** 2, temperature, noise)[0], pick(logits, temperature, noise)[1]

    monkeypatch.setattr(runner_mod, "chain_pick", wrong_q)
    counts, expected, n = sample(2)
    stat, dof = g_statistic(counts, expected, n)
    assert stat > g_test_threshold(dof), f"the wrong q went unnoticed: G={stat:.1f} dof={dof}"


def test_compiled_fused_levels_match_eager(model_dirs):
    path = model_dirs["LlamaForCausalLM"]
    lens, levels = [6, 11], 2  # (each chain length is a graph of its own, traced through every level)
    prompts = [list(range(10, 10 + n)) for n in lens]
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    eager, compiled = runner(path), runner(path, compiled=True)
    # As a background compile serves: eager (its chains deferred), the forwards alone warmed up
    # through a compile view, then swapped in.
    compiled.serve_eager()
    compiled.compile_view().warm_compiled(chains=True)
    compiled.use_compiled()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first = prefill(eager, prompts, tables)
    assert torch.equal(prefill(compiled, prompts, tables), first)
    # Before its chain graphs are warm, a compiled runner's chains run one compiled forward a level:
    # the same tokens, and no graph compiled mid-serving.
    assert torch.equal(fused(compiled, prompts, tables, first, levels), fused(eager, prompts, tables, first, levels))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # Greedy chains only (a drafter that never fuses sampled ones, as one of a narrower vocabulary),
    # warmed through a compile view (its scratch pool) as the background compile does: the runner itself
    # takes them from then on.
    compiled.compile_view().warm_chains(levels, sampled_chains=False)
    assert {(n, several, False) for n in (1, 2) for several in (True, False)} == compiled._chains_ready
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(fused(compiled, prompts, tables, first, levels), fused(eager, prompts, tables, first, levels))
    assert torch.equal(
        fused(compiled, prompts[:1], tables[:1], first[:1], levels),
        one_at_a_time(eager, prompts[:1], tables[:1], first[:1], levels),
    )
    # warm_chains() compiled every greedy chain length up to `levels`, one sequence and several:
    # none mid-serving.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # A sampled chain was left out of the warm-up: it runs level by level on the compiled forwards
    # (no graph compiled for it) and draws what the eager chain draws from the same noise.
    chunks = [ForwardChunk([0] * levels, len(p) + levels, t, levels) for p, t in zip(prompts, tables)]
    temperature = torch.tensor([0.7, 1.3])
    noise = torch.empty(levels, len(lens), eager.vocab_size).exponential_(generator=torch.Generator().manual_seed(0))
    want_t, want_q = eager.chain(eager.prepare_levels(chunks), first, temperature, noise)
    got_t, got_q = compiled.chain(compiled.prepare_levels(chunks), first, temperature, noise)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(got_t, want_t)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-5)
