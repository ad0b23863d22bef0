"""Speculative decoding: trees, lossless verification, the engine loop, the controller."""

from __future__ import annotations

import itertools
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import engine.sampling.accept as accept_mod
import engine.sampling.verify as verify_mod
from conftest import VOCAB, build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.sampling.sampler import SamplingMetadata, apply_logits_processors, compute_probs
from engine.sampling.tree import DraftTree, tree_layout
from engine.sampling.verify import build_verify_input, verify
from engine.speculative.controller import CostModel, Guard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny steps (see conftest)


# -- trees ------------------------------------------------------------------------------------------
def test_tree_layout():
    #        root
    #       /    \
    #     n0(5)  n1(6)
    #     /  \
    #  n2(7) n3(8)
    #    |
    #  n4(9)
    t = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2])
    lay = tree_layout(t)
    assert lay.depths == [0, 1, 1, 2, 2, 3]
    assert lay.children == [[1, 2], [3, 4], [], [5], [], []]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(lay.mask, expected)
    assert DraftTree.chain([1, 2, 3]).is_chain and not t.is_chain
    # A chain's rows are a causal chunk: no mask to build (its forward takes the causal default).
    chain = tree_layout(DraftTree.chain([4, 5, 6]))
    assert chain.mask is None and chain.depths == [0, 1, 2, 3] and chain.children == [[1], [2], [3], []]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1])


# -- verification: named greedy cases ----------------------------------------------------------------
V = 10


def onehot_rows(argmaxes: list[int]) -> torch.Tensor:
    """Greedy target distributions (one-hot at the chosen argmax), one row per tree row."""
    p = torch.zeros(len(argmaxes), V)
    p[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return p


def run_verify(trees: list[DraftTree], argmaxes: list[list[int]]) -> list[list[int]]:
    p = onehot_rows([a for seq in argmaxes for a in seq])
    inp, roots = build_verify_input(p, trees, V)
    out = verify(inp)
    result = []
    for b, t in enumerate(trees):
        acc = [t.tokens[r - roots[b] - 1] for r in out.accepted_rows[b]]
        result.append(acc + [out.final_tokens[b]])
    return result


def test_greedy_perfect_match_gets_bonus():
    assert run_verify([DraftTree.chain([3, 4, 5])], [[3, 4, 5, 6]]) == [[3, 4, 5, 6]]


def test_greedy_early_mismatch_recovers_target_token():
    assert run_verify([DraftTree.chain([3, 4, 5])], [[3, 9, 5, 6]]) == [[3, 9]]
    assert run_verify([DraftTree.chain([3, 4, 5])], [[7, 4, 5, 6]]) == [[7]]


def test_greedy_empty_draft_is_plain_decoding():
    assert run_verify([DraftTree()], [[8]]) == [[8]]


def test_greedy_several_sequences_and_second_child():
    trees = [DraftTree.chain([1, 2]), DraftTree([4, 5, 6], [-1, -1, 1]), DraftTree()]
    # Sequence 1: the root's argmax is 5 (its second child), then 6 under it, then bonus 0.
    argmaxes = [[1, 9, 0], [5, 0, 6, 0], [2]]
    assert run_verify(trees, argmaxes) == [[1, 9], [5, 6, 0], [2]]


# -- verification: distributions (p: target, q: draft) -------------------------------------------------
def g_test_threshold(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p ≈ 0.001 (Wilson–Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def g_statistic(counts: dict, expected: dict[tuple, float], n: int) -> tuple[float, int]:
    """G-test of observed counts against expected probabilities; cells expecting < 5 are pooled. A
    sample in a cell that ``expected`` lacks or gives no probability is impossible under it: G is
    infinite (pooled, a few of them would hardly move it)."""
    impossible = {cell: o for cell, o in counts.items() if o and expected.get(cell, 0.0) <= 0.0}
    if impossible:
        return math.inf, max(1, sum(1 for pr in expected.values() if pr > 0) - 1)
    g, bins, pooled_o, pooled_e = 0.0, 0, 0, 0.0
    for cell, pr in expected.items():
        e, o = n * pr, counts.get(cell, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        bins += 1
        if o:
            g += 2 * o * math.log(o / e)
        g -= 2 * (o - e)  # keeps G well-behaved when totals of the kept cells differ from n
    if pooled_e > 0:
        bins += 1
        if pooled_o:
            g += 2 * pooled_o * math.log(pooled_o / pooled_e)
        g -= 2 * (pooled_o - pooled_e)
    return g, bins - 1


def test_g_statistic_refuses_samples_the_expectation_rules_out():
    """Samples in a cell ``expected`` lacks or gives no probability make G infinite: pooled or dropped,
    2% of the samples there would hardly move it."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, generator=g), 0)
    expected = {(i,): p.item() for i, p in enumerate(probs)} | {(12,): 0.0}
    n = 10_240
    drawn = torch.multinomial(probs, n, replacement=True, generator=g).bincount(minlength=12)
    counts = {(i,): int(c) for i, c in enumerate(drawn)}
    stat, dof = g_statistic(counts, expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    top = max(counts, key=counts.get)
    for outside in [(12,), (13,), (0, 1)]:  # no probability, absent, another shape
        moved = {**counts, top: counts[top] - n // 50, outside: n // 50}
        assert g_statistic(moved, expected, n)[0] == math.inf


def wrong_residual(monkeypatch) -> None:
    """A deliberately wrong rule: after a rejection, sample from p again instead of the residual (the
    rejected draft's q, or its one-hot for a deterministic draft, left in)."""
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    monkeypatch.setattr(verify_mod, "drop_token", lambda P_, x_: P_)


def tabular_speculation(P: torch.Tensor, Q: torch.Tensor, n: int, mode: str, seed: int) -> dict:
    """Sample 3 tokens per sequence from a tabular target P[last] with draft Q[last], n sequences at
    once, through build_verify_input + verify (chains sampled from q, or deterministic argmax chains
    without q, as n-gram lookups draft; trees deterministic top-2)."""
    torch.manual_seed(seed)
    Vt = P.shape[0]
    seqs = torch.zeros(n, 1, dtype=torch.int64)
    out = [[] for _ in range(n)]
    while min(len(o) for o in out) < 3:
        active = [i for i in range(n) if len(out[i]) < 3]
        last = torch.tensor([(out[i][-1] if out[i] else 0) for i in active])
        trees, rows = [], []
        if mode == "chain":
            t1 = torch.multinomial(Q[last], 1)[:, 0]
            t2 = torch.multinomial(Q[t1], 1)[:, 0]
            for j in range(len(active)):
                a, b, c = last[j].item(), t1[j].item(), t2[j].item()
                trees.append(DraftTree.chain([b, c], torch.stack([Q[a], Q[b]])))
                rows += [P[a], P[b], P[c]]
        elif mode == "argmax-chain":  # the second sequence of each pair drafts nothing
            t1 = Q[last].argmax(-1)
            t2 = Q[t1].argmax(-1)
            for j in range(len(active)):
                a, b, c = last[j].item(), t1[j].item(), t2[j].item()
                trees.append(DraftTree.chain([b, c] if j % 2 == 0 else []))
                rows += [P[a], P[b], P[c]] if j % 2 == 0 else [P[a]]
        else:
            top = Q[last].topk(2).indices
            for j in range(len(active)):
                a = last[j].item()
                kids = top[j].tolist()
                grand = Q[kids[0]].topk(2).indices.tolist()
                trees.append(DraftTree(kids + grand, [-1, -1, 0, 0]))
                rows += [P[a], P[kids[0]], P[kids[1]], P[grand[0]], P[grand[1]]]
        inp, roots = build_verify_input(torch.stack(rows), trees, Vt)
        res = verify(inp)
        for j, i in enumerate(active):
            toks = [trees[j].tokens[r - roots[j] - 1] for r in res.accepted_rows[j]] + [res.final_tokens[j]]
            out[i].extend(toks)
    del seqs
    counts: dict = {}
    for o in out:
        key = tuple(o[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def tabular_joint(P: torch.Tensor) -> dict[tuple, float]:
    Vt = P.shape[0]
    return {(a, b, c): (P[0, a] * P[a, b] * P[b, c]).item() for a, b, c in itertools.product(range(Vt), repeat=3)}


def tabular_pair(Vt: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A tabular target P[last] (shaped with temperature, top-k and top-p exactly as the engine does)
    and a draft Q[last] that often disagrees with it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(Vt, Vt, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    md = SamplingMetadata.build([params] * Vt, [[1]] * Vt, [[]] * Vt, [None] * Vt, [], Vt, "cpu")
    return compute_probs(logits, md), torch.softmax(logits + torch.randn(Vt, Vt, generator=g), -1)


@pytest.mark.parametrize("mode", ["chain", "argmax-chain", "tree"])
def test_tabular_speculation_matches_target_and_wrong_rule_fails(mode, monkeypatch):
    P, Q = tabular_pair()
    n = 24_000
    expected = tabular_joint(P)
    stat, dof = g_statistic(tabular_speculation(P, Q, n, mode, seed=1), expected, n)
    assert stat < g_test_threshold(dof), f"{mode}: G={stat:.1f} dof={dof}"
    wrong_residual(monkeypatch)
    stat, dof = g_statistic(tabular_speculation(P, Q, n, mode, seed=2), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


# -- engine fixtures -----------------------------------------------------------------------------------
def noisy_copy(src, dst, scale: float, seed: int = 0):
    """A draft: the target's weights plus noise, so it agrees often but not always."""
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for k, t in w.items():
        if t.dim() > 1:
            w[k] = t + scale * t.std() * torch.randn(t.shape, generator=g)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("spec")
    target = build_model_dir(root / "target", tokenizer_dir, "LlamaForCausalLM", std=0.3)
    return {
        "target": target,
        "same": noisy_copy(target, root / "same", 0.0),
        "noisy": noisy_copy(target, root / "noisy", 0.6),
        "random": build_model_dir(root / "random", tokenizer_dir, "LlamaForCausalLM", seed=123, std=0.3),
    }


def make(target, draft=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    kw.setdefault("block_size", 4)
    kw.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(model=str(target), draft_model=str(draft) if draft else None, **kw))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def staggered(engine: LLMEngine, ps: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    pending = list(enumerate(ps))
    out: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            for _ in range(2):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(f"r{i}", p, params)
                    out[f"r{i}"] = []
        for o in engine.step():
            out[o.request_id].extend(o.outputs[0].delta_token_ids)
        step += 1
    return out


# -- greedy identity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_speculation_is_identical_to_plain(pair, topk):
    ps = prompts(22, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=4)
    plain = staggered(make(pair["target"]), ps, params)
    # Small pool (preemption) and prefix caching on; a draft that is right often but not always.
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=topk, num_kv_blocks=60, max_num_batched_tokens=96)
    preempted = []
    orig = eng.scheduler._preempt
    eng.scheduler._preempt = lambda seq, out: (preempted.append(seq.seq_id), orig(seq, out))
    spec = staggered(eng, ps, params)
    assert spec == plain
    st = eng.spec_stats
    assert preempted, "the pool was meant to force preemption"
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, "the draft should be right sometimes, not always"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_cached_size_draft_runs_in_float32_under_a_bf16_target_on_cpu(pair, monkeypatch):
    """On a CPU without the small-rows bf16 kernel, a draft whose float32 weights fit in the last-level
    cache runs in float32 under a bf16 target (its own KV cache too), and greedy speculation still
    gives the bf16 target's plain tokens; a draft too large for the cache keeps the target's dtype.
    Where the kernel serves, the draft runs in the target's bf16, with the same tokens."""
    import engine.speculative.methods.draft_model as draft_model

    ps = prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=4)
    plain = staggered(make(pair["target"], dtype="bfloat16"), ps, params)
    if draft_model.small_rows_serve(torch.bfloat16, torch.device("cpu")):
        eng = make(pair["target"], pair["same"], dtype="bfloat16")
        assert eng.proposer.runner.dtype == torch.bfloat16
        assert staggered(eng, ps, params) == plain
    monkeypatch.setattr(draft_model, "small_rows_serve", lambda dtype, device: False)
    monkeypatch.setattr(draft_model, "last_level_cache_bytes", lambda: 32 * 2**20)
    eng = make(pair["target"], pair["same"], dtype="bfloat16")
    runner = eng.proposer.runner
    assert eng.runner.dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.kv_cache.dtype == torch.float32
    assert staggered(eng, ps, params) == plain
    assert eng.spec_stats.num_accepted_tokens > 0
    monkeypatch.setattr(draft_model, "last_level_cache_bytes", lambda: 0)  # no cache information, or too small
    assert make(pair["target"], pair["same"], dtype="bfloat16").proposer.runner.dtype == torch.bfloat16
    assert make(pair["target"], pair["same"]).proposer.runner.dtype == torch.float32


def test_speculation_with_stops_penalties_and_logprobs(pair):
    ps = prompts(6, seed=2)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2, num_draft_tokens=3
    )
    plain = make(pair["target"]).generate(ps, params)
    spec = make(pair["target"], pair["same"], spec_tree_topk=2).generate(ps, params)
    for a, b in zip(plain, spec):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.delta_token_ids == cb.delta_token_ids and ca.finish_reason == cb.finish_reason
        assert [x.token_id for x in cb.delta_logprobs] == cb.delta_token_ids
        for x, y in zip(ca.delta_logprobs, cb.delta_logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # Stop strings cut speculative output exactly where plain decoding stops.
    text = plain[0].outputs[0].text
    if len(text) > 6:
        stop = text[3:6]
        p2 = SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], num_draft_tokens=4)
        a = make(pair["target"]).generate([ps[0]], p2)[0].outputs[0]
        b = make(pair["target"], pair["same"]).generate([ps[0]], p2)[0].outputs[0]
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason)


# -- KV consistency and leaks ----------------------------------------------------------------------------------
def slots_of(seq, n: int, bs: int) -> torch.Tensor:
    return torch.tensor([seq.block_table[i // bs] * bs + i % bs for i in range(n)])


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_kv_consistent_after_rejections(pair, topk):
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=topk)
    ps = prompts(4, seed=3)
    for i, p in enumerate(ps):
        eng.add_request(
            f"k{i}", p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, num_draft_tokens=4)
        )
    for _ in range(12):
        eng.step()
    assert eng.spec_stats.num_draft_tokens > eng.spec_stats.num_accepted_tokens > 0
    fresh = make(pair["target"], pair["noisy"], spec_tree_topk=topk)
    bs = 4
    for seq in eng.scheduler.running:
        n, nd = seq.num_computed_tokens, seq.draft_num_computed
        table: list[int] = []
        assert fresh.block_manager.reserve(table, 0, n) is not None
        from engine.runner.model_runner import ForwardChunk

        fresh.runner.forward([ForwardChunk(seq.token_ids[:n], 0, table, 1)])
        fresh.proposer.runner.forward([ForwardChunk(seq.token_ids[:nd], 0, table, 1)])
        ref_slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
        got = eng.runner.kv_cache[:, :, slots_of(seq, n, bs)]
        torch.testing.assert_close(got, fresh.runner.kv_cache[:, :, ref_slots], atol=1e-4, rtol=1e-4)
        got_d = eng.proposer.runner.kv_cache[:, :, slots_of(seq, nd, bs)]
        torch.testing.assert_close(got_d, fresh.proposer.runner.kv_cache[:, :, ref_slots[:nd]], atol=1e-4, rtol=1e-4)
        fresh.block_manager.free(table)


def test_no_block_leaks_after_many_mixed_requests(pair):
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=2, num_kv_blocks=200, max_num_seqs=48)
    rng = random.Random(5)
    total = 1000
    added = finished = 0
    live: list[str] = []
    while finished < total:
        while added < total and len(live) < 48:
            rid = f"m{added}"
            p = SamplingParams(
                n=rng.choice([1, 1, 1, 2]),
                temperature=rng.choice([0.0, 0.8]),
                top_k=rng.choice([0, 5]),
                max_tokens=rng.randint(1, 8),
                ignore_eos=True,
                speculative=rng.choice([None, None, False]),
                num_draft_tokens=rng.choice([None, 2, 4]),  # pinned depths draft whatever the timings say
                seed=rng.choice([None, 7]),
            )
            eng.add_request(rid, [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))], p)
            live.append(rid)
            added += 1
        if rng.random() < 0.05 and live:
            victim = live.pop(rng.randrange(len(live)))
            assert eng.abort(victim)
            finished += 1
        for o in eng.step():
            if o.finished:
                live.remove(o.request_id)
                finished += 1
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_invariants()
    assert eng.spec_stats.num_drafts > 0


# -- sampled distribution through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A real tiny Llama with an 8-token vocabulary, and a noisy draft of it."""
    root = tmp_path_factory.mktemp("small-vocab")
    words = ["<|bos|>", "<|eos|>", "<|pad|>", "a", "b", "c", "d", "e"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    tok_dir = root / "tok"
    fast.save_pretrained(tok_dir)
    target = build_model_dir(root / "target", tok_dir, "LlamaForCausalLM", vocab_size=8, std=0.5)
    return target, noisy_copy(target, root / "draft", 0.8)


def exact_joint(target_dir, prompt: list[int], params: SamplingParams, skip: int = 0) -> dict[tuple, float]:
    """The target's exact distribution of its sampled tokens ``skip + 1 .. skip + 3`` under the request's
    shaping (the first ``skip`` summed out)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    Vs = model.config.vocab_size

    def dist(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + x for x in prefixes])).logits[:, -1].float()
        md = SamplingMetadata.build(
            [params] * len(prefixes), [prompt] * len(prefixes), prefixes, [None] * len(prefixes), [1], Vs, "cpu"
        )
        return compute_probs(apply_logits_processors(logits, md), md)

    joint, prefixes = torch.ones(()), [[]]  # over the tokens so far: [Vs] * level
    for level in range(skip + 3):
        joint = joint.unsqueeze(-1) * dist(prefixes).view(*[Vs] * (level + 1))
        prefixes = [x + [a] for x in prefixes for a in range(Vs)]
    joint = joint.sum(dim=tuple(range(skip))) if skip else joint
    return {k: joint[k].item() for k in itertools.product(range(Vs), repeat=3)}


def sample_counts(eng: LLMEngine, params: SamplingParams, prompt: list[int], n: int, skip: int = 0) -> dict:
    """How often each three tokens after the first ``skip`` came out of ``n`` samples (requests of 64
    choices each)."""
    for i in range(n // 64):
        eng.add_request(f"s{i}", prompt, SamplingParams(**{**params.__dict__, "n": 64}))
    toks: dict = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                toks.setdefault((o.request_id, c.index), []).extend(c.delta_token_ids)
    counts: dict = {}
    for v in toks.values():
        key = tuple(v[skip : skip + 3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def engine_samples(target, draft, topk: int, params: SamplingParams, prompt: list[int], n: int, **kw) -> dict:
    eng = make(target, draft, spec_tree_topk=topk, num_kv_blocks=4096, max_num_seqs=1024, block_size=8, **kw)
    counts = sample_counts(eng, params, prompt, n)
    assert eng.spec_stats.num_drafts > 0
    return counts


@pytest.fixture(scope="module")
def close_draft(small_vocab_pair, tmp_path_factory):
    """A draft nearer the small-vocabulary target than its own (noise 0.3, not 0.8): the target keeps
    some of its tokens and turns others down at the counted positions, where the residual rule acts
    (the far draft's tokens there are all turned down, with no mass in the target: any rule passes)."""
    return noisy_copy(small_vocab_pair[0], tmp_path_factory.mktemp("close") / "draft", 0.3)


# 5 tokens, the first 3 counted: the second step drafts 3 deep. Measured at n = 20,480 (12 cells of the
# joint expecting 5 or more): G about 10 (chains) and 5 (trees), and under the wrong rule 2,400 and 3,500.
SAMPLED = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_tokens=5, ignore_eos=True, num_draft_tokens=3)
SAMPLED_PROMPT = [0, 5, 6, 7, 3]


def check_speculative_sampling(target, draft, topk: int, monkeypatch, n: int = 10_240, **kw) -> None:
    """Sampled speculation through the engine (chains for ``topk`` 1, top-k trees else) gives the target's
    exact joint distribution of three tokens (a G-test at p ~ 0.001), and the same test at the same ``n``
    rejects the samples of the wrong rule (:func:`wrong_residual`)."""
    expected = exact_joint(target, SAMPLED_PROMPT, SAMPLED)
    stat, dof = g_statistic(engine_samples(target, draft, topk, SAMPLED, SAMPLED_PROMPT, n, **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    with monkeypatch.context() as m:
        wrong_residual(m)
        stat, dof = g_statistic(engine_samples(target, draft, topk, SAMPLED, SAMPLED_PROMPT, n, **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_engine_sampling_distribution_matches_target(small_vocab_pair, close_draft, topk, monkeypatch):
    check_speculative_sampling(small_vocab_pair[0], close_draft, topk, monkeypatch)


def check_plain_sampling(target, draft, monkeypatch, n: int = 20_480, **kw) -> None:
    """Sampled rows without a draft (one inverse-CDF draw each: accept_random's plain path) give the
    target's exact joint distribution, and the same test at the same ``n`` rejects a wrong draw."""
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_tokens=3, ignore_eos=True, speculative=False)
    prompt = [0, 3, 4, 5]
    expected = exact_joint(target, prompt, params)
    stat, dof = g_statistic(plain_samples(target, draft, params, prompt, n, **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    # A deliberately wrong draw: an off-by-one in the inverse CDF (the token after the one found).
    right = accept_mod.draw
    with monkeypatch.context() as m:
        m.setattr(accept_mod, "draw", lambda P, u: (right(P, u) + 1).clamp(max=P.shape[1] - 1))
        stat, dof = g_statistic(plain_samples(target, draft, params, prompt, n, **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong draw went unnoticed: G={stat:.1f} dof={dof}"


def test_plain_sampling_matches_target_and_a_wrong_draw_fails(small_vocab_pair, monkeypatch):
    check_plain_sampling(*small_vocab_pair, monkeypatch)


def plain_samples(target, draft, params: SamplingParams, prompt: list[int], n: int, **kw) -> dict:
    eng = make(target, draft, num_kv_blocks=4096, max_num_seqs=1024, block_size=8, **kw)
    counts = sample_counts(eng, params, prompt, n)
    assert eng.spec_stats.num_drafts == 0
    return counts


def test_fused_sampled_chains_keep_the_targets_distribution(small_vocab_pair, monkeypatch, tmp_path):
    """At a temperature alone a draft model's chains run their levels past the first in one call,
    drawing each token inside it (``ModelRunner.chain``); samples still follow the target.
    (``test_chain_levels.py`` checks that each token is a draw from the ``q`` returned with it.)"""
    from engine.speculative.methods.draft_model import DraftModelProposer

    target, _ = small_vocab_pair
    draft = noisy_copy(target, tmp_path / "close", 0.1)  # close: the fused levels' tokens are often accepted
    # Room for depth-3 drafts after the first token (the test reads the first three tokens).
    params = SamplingParams(temperature=0.5, max_tokens=6, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 5]
    n = 10_240
    calls = []
    fused = DraftModelProposer._chain_levels
    monkeypatch.setattr(DraftModelProposer, "_chain_levels", lambda *a: calls.append(1) or fused(*a))
    expected = exact_joint(target, prompt, params)
    stat, dof = g_statistic(engine_samples(target, draft, 1, params, prompt, n), expected, n)
    assert calls and stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof} (fused calls: {len(calls)})"
    calls.clear()
    wrong_residual(monkeypatch)
    stat, dof = g_statistic(engine_samples(target, draft, 1, params, prompt, n), expected, n)
    assert calls and stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded-sampling"])
def test_fused_chain_levels_draft_what_one_forward_per_level_drafts(pair, monkeypatch, temperature):
    """A draft model's chain levels in one call (its ``_chain_levels``) and ``LevelDrafter``'s
    default (one ``_level`` forward per level, the same pick) draft the same tokens: the same
    outputs, and the same acceptance at every depth."""
    from engine.speculative.levels import LevelDrafter
    from engine.speculative.methods.draft_model import DraftModelProposer

    ps = prompts(4, seed=11)
    params = SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=16,
                            ignore_eos=True, num_draft_tokens=3)  # fmt: skip
    runs = []
    for impl in (DraftModelProposer._chain_levels, LevelDrafter._chain_levels):
        calls = []
        spy = lambda *a, f=impl, c=calls: c.append(1) or f(*a)  # noqa: E731
        monkeypatch.setattr(DraftModelProposer, "_chain_levels", spy)
        eng = make(pair["target"], pair["same"], spec_tree_topk=1)
        out = [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)]
        assert calls
        runs.append((out, list(eng.spec_stats.accepted_per_pos)))
    assert runs[0] == runs[1]
    assert sum(runs[0][1][1:]) > 0  # some chains kept tokens past the first level


def test_no_repeat_ngrams_stay_exact_under_speculation_and_a_wrong_rule_fails(small_vocab_pair, monkeypatch):
    """no_repeat_ngram_size shapes every verified row as plain sampling would (a tree node's history
    includes the path above it), so speculative samples follow the banned distribution exactly; a
    rule that forgets the path (bans from the sequence's own tokens only) is caught."""
    import engine.sampling.accept as accept_mod

    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, num_draft_tokens=3, no_repeat_ngram_size=1)
    prompt = [0, 3]
    n = 10_240
    expected = exact_joint(target, prompt, params)
    stat, dof = g_statistic(engine_samples(target, draft, 1, params, prompt, n), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    forgetful = accept_mod.banned_tokens
    monkeypatch.setattr(accept_mod, "banned_tokens", lambda seq, path=(): forgetful(seq))
    stat, dof = g_statistic(engine_samples(target, draft, 1, params, prompt, n), expected, n)
    assert stat > g_test_threshold(dof), f"the path-blind rule went unnoticed: G={stat:.1f} dof={dof}"


# -- the controller -----------------------------------------------------------------------------------------
def cheap_draft_costs(target_per_token: float = 0.0) -> CostModel:
    """Timings of a small draft next to a big target: a target forward costs 10 ms (+ per token when
    the batch saturates the device), a draft forward 1 ms."""
    cost = CostModel()
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        cost.observe("target", 1, t, 0.010 + target_per_token * t)
        cost.observe("draft", 1, t, 0.001)
    return cost


def test_controller_long_with_identical_draft_and_off_with_random_draft(pair):
    ps = prompts(2, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    # The drafts here cost as much as the target (same tiny model), so the real cost model is
    # replaced before each step by the timings of a small draft next to a big target.
    # (Ordinary steps: the plans below are asked between steps, of sequences with their root uncomputed.)
    good = make(pair["target"], pair["same"], spec_tree_topk=1, num_speculative_tokens=6, async_scheduling="off")
    for i, p in enumerate(ps):
        good.add_request(f"g{i}", p, params)
    for _ in range(30):
        good.controller.cost = cheap_draft_costs()
        good.step()
    decode = [s for s in good.scheduler.running if s.num_uncomputed_tokens == 1]
    # Its acceptance estimates say every draft token is kept (the depth grows as they rise) ...
    assert len(decode) == 2
    assert all(min(s.spec_estimate.alpha[:5]) > 0.9 for s in decode)
    # ... so with a cheap draft it drafts as long as allowed (once the hysteresis lets it move),
    good.controller.cost = cheap_draft_costs()
    # The guard measures real steps, where this "draft" costs as much as the target: judged alone, the
    # plan needs a fresh guard (and no early plain probes in these direct plan() calls).
    good.controller.guard = Guard(6, min_samples=0)
    good.controller.reuse_plans = 0  # every plan searches: the hysteresis counts searched plans
    plans = [good.controller.plan(decode, 0) for _ in range(good.controller.patience + 1)]
    assert plans[-1] == [6, 6]
    # but when every batched token costs real target time (a saturated device), a draft that is right
    # 90% of the time loses, and speculation turns off (after the hysteresis' few steps).
    good.controller.cost = cheap_draft_costs(target_per_token=0.02)
    for seq in decode:
        seq.spec_estimate.alpha = [0.9] * 6
    plans = [good.controller.plan(decode, 2000) for _ in range(4)]
    assert plans[-1] == [0] * len(decode)

    bad = make(pair["target"], pair["random"], spec_tree_topk=1, num_speculative_tokens=6, async_scheduling="off")
    for i, p in enumerate(ps):
        bad.add_request(f"b{i}", p, params)
    for _ in range(20):
        bad.controller.cost = cheap_draft_costs()
        bad.step()
    bad.controller.cost = cheap_draft_costs()
    bad.controller.guard = Guard(6, min_samples=0)
    decode = [s for s in bad.scheduler.running if s.num_uncomputed_tokens == 1]
    assert len(decode) == 2 and bad.controller.plan(decode, 0) == [0, 0]
    drafts_before = bad.proposer.num_forwards
    bad.step()  # K = 0 everywhere is a true bypass: no draft forward at all
    assert bad.proposer.num_forwards == drafts_before


def test_draft_with_other_vocabulary_is_a_startup_error(pair, tmp_path):
    other_tok = tmp_path / "tok"
    tok = Tokenizer(models.WordLevel({"<|pad|>": 0, "x": 1}, unk_token="<|pad|>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>").save_pretrained(other_tok)
    d = build_model_dir(tmp_path / "d", other_tok, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="different tokenizer vocabulary"):
        make(pair["target"], d)


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_forked_choices_share_blocks_and_stay_exact(pair, topk):
    """n > 1 choices share the prompt's blocks (copy-on-write in both KV pools) while speculating."""
    ps = prompts(3, seed=11)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    plain = make(pair["target"]).generate(ps, params)
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=topk)
    spec = eng.generate(ps, params)
    for a, b in zip(plain, spec):
        assert [c.delta_token_ids for c in a.outputs] == [c.delta_token_ids for c in b.outputs]
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_draft_with_differently_padded_vocabulary(pair, tmp_path, tokenizer_dir):
    """Same tokenizer, smaller embedding table (as Qwen2.5-0.5B next to Qwen2.5-7B): still exact."""
    draft = build_model_dir(tmp_path / "narrow", tokenizer_dir, "LlamaForCausalLM", vocab_size=VOCAB - 4)
    ps = prompts(4, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    plain = make(pair["target"]).generate(ps, params)
    eng = make(pair["target"], draft, spec_tree_topk=2)
    spec = eng.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in plain] == [o.outputs[0].delta_token_ids for o in spec]
    assert eng.spec_stats.num_drafts > 0
