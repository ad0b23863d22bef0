"""Ouroboros: the draft model drafting by pooled phrases (engine/speculative/methods/ouroboros.py)."""

from __future__ import annotations

import pytest
import torch
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, noisy_copy, small_vocab_pair, staggered  # noqa: F401
from test_spec import make as make_pair_engine
from test_step import check_n_choices
from test_step import prompts as repetitive_prompts

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.request.sampling_params import SamplingParams
from engine.sampling.tree import DraftTree
from engine.speculative.methods.ouroboros import OuroborosProposer, PhrasePool, _chain_length
from engine.speculative.proposer import VerifyRows


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    """A small-weight random target, whose greedy text falls into loops (so the pool has phrases that
    come true), a draft that agrees with it now and then, and one that never does."""
    root = tmp_path_factory.mktemp("ouroboros")
    target = build_model_dir(root / "target", tokenizer_dir, "LlamaForCausalLM", std=0.08)
    random = build_model_dir(root / "random", tokenizer_dir, "LlamaForCausalLM", seed=123, std=0.3)
    return {"target": target, "noisy": noisy_copy(target, root / "noisy", 0.2), "random": random}


def make(pair_, draft="noisy", **kw):
    return make_pair_engine(pair_["target"], pair_[draft], speculative_method="ouroboros", **kw)


def test_the_phrase_pool_keys_by_two_tokens_then_one():
    pool = PhrasePool(length=3)
    pool.add_text([1, 2, 3, 4, 5, 6])
    # After 2 (1 before it): 3, 4, 5; after 3 (2 before it): 4, 5, 6. Phrases need all their tokens.
    assert pool.lookup(1, 2) == (3, 4, 5) and pool.lookup(2, 3) == (4, 5, 6)
    assert pool.lookup(9, 2) == (3, 4, 5), "an unseen pair falls back to the token alone"
    assert pool.lookup(5, 6) == () and pool.pos == 3
    pool.add_text([1, 2, 3, 4, 5, 6, 2, 7, 7, 7])  # only what is new is read
    assert pool.lookup(9, 2) == (7, 7, 7), "the newest phrase after a token wins"
    assert pool.lookup(1, 2) == (3, 4, 5), "the two-token key keeps its own"
    pool.add(0, 2, [8, 8, 8, 8, 8])
    assert pool.lookup(0, 2) == (8, 8, 8), "phrases are cut to the pool's length"
    twin = pool.copy()
    twin.add(0, 2, [9])
    assert pool.lookup(0, 2) == (8, 8, 8) and twin.lookup(0, 2) == (9,)


def test_verification_leftovers_become_phrases_after_the_correction(pair):
    """A chain [10, 11, 12, 13] (under root 5) whose node 1 the step turned down for 21 (sampled: the
    target's argmax there was 20): the draft's tokens after the rejected one, and the target's own
    outputs over those rows while the draft agreed with them, become phrases after what was emitted."""
    eng = make(pair, ouroboros_phrase=4)
    proposer: OuroborosProposer = eng.proposer
    eng.add_request("r", [3, 4, 5], SamplingParams(max_tokens=8))
    seq = eng.scheduler.waiting[0]
    seq.num_computed_tokens = 3 + 1  # committed: the root (index 2) and the accepted node 0
    tree = DraftTree([10, 11, 12, 13], [-1, 0, 1, 2])
    vocab = eng.runner.vocab_size
    said = [10, 20, 12, 30, 40]  # the target's argmax after the root, node 0, 1, 2 and 3
    logits = torch.zeros(len(said), vocab)
    logits[torch.arange(len(said)), torch.tensor(said)] = 1.0
    proposer.on_verify_logits([VerifyRows(seq, tree, [0], [10, 21], 0)], logits)
    pool = proposer._pools[seq.seq_id]
    # The newest: the target's after the rejected 11 (12), and 30 after it since the draft also said 12.
    assert pool.lookup(10, 21) == (12, 30) and (10, 20) not in pool.phrases.grams
    assert list(pool.phrases.grams[(10, 21)]) == [(12, 13), (12, 30)], "the draft's tail first, then the target's"
    all_kept = VerifyRows(seq, tree, [0, 1, 2, 3], [10, 11, 12, 13, 40], 0)
    proposer.on_verify_logits([all_kept], logits)  # nothing was turned down: nothing to learn
    assert list(pool.phrases.grams[(10, 21)]) == [(12, 13), (12, 30)]


@pytest.mark.parametrize("temperature", [0.0, 0.3], ids=["greedy", "seeded"])
def test_phrase_drafting_drafts_what_one_forward_per_token_drafts(pair, temperature):
    """Without branches, the draft's chains are exactly the draft-model method's (token by token, the
    same draws for a seeded request), in fewer draft forwards once the pool knows the text."""
    ps = repetitive_prompts(6, seed=4)
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=64, ignore_eos=True, num_draft_tokens=4)
    engines = {
        m: make_pair_engine(pair["target"], pair["noisy"], speculative_method=m, ouroboros_branches=0)
        for m in ("draft", "ouroboros")
    }
    trees = {m: [] for m in engines}
    for m, eng in engines.items():
        propose = eng.proposer.propose

        def spy(seqs, depths, ctx, propose=propose, out=trees[m]):
            got = propose(seqs, depths, ctx)
            out.extend((s.group.request_id, list(s.token_ids), t.tokens, t.parents) for s, t in zip(seqs, got))
            return got

        eng.proposer.propose = spy
    outs = {m: [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] for m, eng in engines.items()}
    assert outs["draft"] == outs["ouroboros"]
    assert trees["draft"] == trees["ouroboros"] and len(trees["draft"]) > 20
    assert engines["ouroboros"].proposer.num_phrase_tokens > 0, "repetitive text: phrases must be taken"
    assert engines["ouroboros"].proposer.num_forwards < engines["draft"].proposer.num_forwards


@pytest.mark.parametrize("branches", [1, 3])
def test_greedy_output_is_the_plain_decoders(pair, branches):
    """Preemption (a small pool), prefix reuse, staggered arrivals, a draft right often but not always."""
    ps = repetitive_prompts(16, seed=2) + repetitive_prompts(4, seed=2)  # the repeats hit the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=4)
    plain = staggered(make_pair_engine(pair["target"]), ps, params)
    eng = make(pair, num_kv_blocks=36, max_num_batched_tokens=48, ouroboros_branches=branches)
    preempted = []
    orig = eng.scheduler._preempt
    eng.scheduler._preempt = lambda seq, out: (preempted.append(seq.seq_id), orig(seq, out))
    assert staggered(eng, ps, params) == plain
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0 and eng.proposer.num_phrase_tokens > 0
    assert preempted, "the small pool was meant to force preemption"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.proposer._pools, "finished sequences leave no pool behind"


def test_branches_are_verified_beside_the_chain(pair):
    """With a draft that is often wrong, turned-down phrase tails ride in the verify forward as branches
    (never deeper than the planned depth), and some are what the target says."""
    eng = make(pair, draft="random", ouroboros_branches=2)
    seen = []
    propose = eng.proposer.propose

    def spy(seqs, depths, ctx):
        got = propose(seqs, depths, ctx)
        seen.extend((t, d) for t, d in zip(got, depths) if len(t))
        return got

    eng.proposer.propose = spy
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=4)
    ps = repetitive_prompts(8, seed=5)
    plain = [o.outputs[0].delta_token_ids for o in make_pair_engine(pair["target"]).generate(ps, params)]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
    branched = [(t, d) for t, d in seen if any(p != i - 1 for i, p in enumerate(t.parents))]
    assert branched, "phrases the draft turned down must be verified"
    assert all(t.depth <= d and len(t) <= eng.proposer.slots_needed(d) for t, d in seen)


def test_n_choices_stay_exact(pair):
    check_n_choices(make_pair_engine(pair["target"]), make(pair))


def test_sampled_output_keeps_the_targets_distribution_and_a_wrong_rule_fails(small_vocab_pair, monkeypatch):  # noqa: F811
    target_dir, draft_dir = small_vocab_pair
    # The first 3 tokens are counted; 5 let the second step draft 3 deep (a phrase forward, branches).
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=5, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 5, 3, 4, 6, 3, 4, 5, 3]  # phrases after 3 and 4: the draft and the pool disagree often
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = {"draft_model": str(draft_dir), "ouroboros_branches": 2, "max_num_batched_tokens": 16384}
    shapes = {"trees": 0, "branched": 0}
    tree_of = OuroborosProposer._tree

    def counted(self, seq, d, depth):
        tree = tree_of(self, seq, d, depth)
        shapes["trees"] += 1
        shapes["branched"] += any(p != i - 1 for i, p in enumerate(tree.parents))
        return tree

    monkeypatch.setattr(OuroborosProposer, "_tree", counted)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "ouroboros", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    assert shapes["branched"] > shapes["trees"] // 10, "sampled drafts with branches were verified"

    # A wrong rule for the branches alone: their nodes claim to be drawn from a uniform q, not one-hot.
    def uniform_branches(self, seq, d, depth):
        tree = counted(self, seq, d, depth)
        if tree.q is not None:
            tree.q[_chain_length(tree) :] = 1.0 / tree.q.shape[1]
        return tree

    monkeypatch.setattr(OuroborosProposer, "_tree", uniform_branches)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "ouroboros", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"a wrong rule for branches went unnoticed: G={stat:.1f} dof={dof}"
    # And a wrong residual after the draft's own nodes.
    monkeypatch.setattr(OuroborosProposer, "_tree", counted)
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "ouroboros", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_it_needs_a_draft_model(pair):
    with pytest.raises(ValueError, match="needs --draft-model"):
        make_pair_engine(pair["target"], speculative_method="ouroboros")
