"""Suffix decoding (``--speculative-method suffix``): its counts and bounded store, trees through the
engine with greedy identity and the target's distribution, the store under concurrent requests,
eviction and abort, and no draft work without a match."""

from __future__ import annotations

import random

from test_ngram import samples, target  # noqa: F401
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts

import engine.sampling.verify as verify_mod
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import FinishReason, SequenceGroup
from engine.speculative.methods.suffix import ContextCounts, SuffixProposer, SuffixStore


def test_store_is_bounded_and_forgets_exactly_what_it_evicts():
    rng = random.Random(0)
    outputs = [[rng.randrange(20) for _ in range(rng.randint(3, 40))] for _ in range(60)]
    store = SuffixStore(capacity=200, order=3)
    for o in outputs:
        store.add(o)
        assert store.num_tokens <= 200
    # The counts are exactly those of the outputs still held (evictions uncounted every entry).
    fresh = ContextCounts(3)
    for kept in store.outputs:
        fresh.add(list(kept))
    assert store.counts.table == fresh.table
    assert sum(len(k) for k in store.outputs) == store.num_tokens
    before = list(store.outputs)
    store.add(list(before[0]))  # produced again: refreshed, not duplicated
    assert list(store.outputs) == before[1:] + before[:1]


def test_trees_follow_counts_best_first():
    p = SuffixProposer(order=2, cache_tokens=100, budget=6, width=2, min_prob=0.1)
    own = ContextCounts(2)
    own.add([1, 2, 3, 1, 2, 4, 1, 2, 3, 5])
    tree = p.draft([7, 1, 2], own, depth=3, max_nodes=6, store=SuffixStore(100, 2))
    # After [1, 2]: 3 twice, 4 once → 3 first (2/3), then its continuations, then 4 (1/3) ...
    assert tree.tokens[0] == 3 and tree.parents[0] == -1
    assert 4 in [t for t, par in zip(tree.tokens, tree.parents) if par == -1]
    assert len(tree) <= 6
    assert (
        p.draft([9, 9, 9], own, depth=3, max_nodes=6, store=SuffixStore(100, 2)).tokens == []
    )  # nothing matches: no draft


def test_greedy_output_is_the_plain_decoders_and_the_store_fills(target):  # noqa: F811
    prompts = repetitive_prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    eng = make(target, "suffix", num_kv_blocks=64, max_num_batched_tokens=48, spec_tree_topk=2)
    pinned = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=4)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts, pinned)] == plain
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.proposer._requests
    assert len(eng.proposer.stores[(None, None)].outputs) == len({tuple(o) for o in plain})
    # A second pass drafts from the store too: same output, more accepted per draft.
    again = [o.outputs[0].delta_token_ids for o in eng.generate(prompts, pinned)]
    assert again == plain


def test_aborted_requests_are_not_stored(target):  # noqa: F811
    eng = make(target, "suffix")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.add_request("kept", [5, 6, 7, 5, 6], params)
    eng.add_request("dropped", [8, 9, 10, 8, 9], params)
    for _ in range(3):
        eng.step()
    assert eng.abort("dropped")
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.proposer.stores[(None, None)].outputs) == 1
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_request_without_a_match_costs_no_draft_work(target):  # noqa: F811
    eng = make(target, "suffix")
    eng.generate([list(range(10, 40))], SamplingParams(temperature=0.0, max_tokens=1, num_draft_tokens=3))
    assert eng.spec_stats.num_drafts == 0


def test_sampled_trees_keep_the_targets_distribution_and_a_wrong_rule_fails(small_vocab_pair, monkeypatch):  # noqa: F811
    target_dir, _ = small_vocab_pair
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 3, 5, 3, 4, 3, 6, 3]  # after 3: 4, 5, 6 — the trees branch
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "suffix"), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    monkeypatch.setattr(verify_mod, "drop_token", lambda P_, x_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "suffix"), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_the_store_never_drafts_one_tenants_or_adapters_text_into_anothers():
    """A finished output is drafted from for later requests of its own adapter and API key only: the
    same context under another key, or another adapter, finds nothing to draft."""
    p = SuffixProposer(order=3, cache_tokens=100, budget=6, width=2)

    def seq(lora: str | None, tenant: str | None):
        return SequenceGroup("r", [40, 41, 7, 8], SamplingParams(lora=lora, tenant=tenant), 0.0).seqs[0]

    p.store(seq(None, "key-a")).add([7, 8, 9, 10, 11])  # a finished output of key a on the base model
    assert p.propose([seq(None, "key-a")], [3], None)[0].tokens[:3] == [9, 10, 11]
    for other in (seq(None, "key-b"), seq("sql", "key-a"), seq(None, None)):
        assert p.propose([other], [3], None)[0].tokens == [], other.draft_namespace
    assert set(p.stores) == {(None, "key-a"), (None, "key-b"), ("sql", "key-a"), (None, None)}


def test_the_stores_together_keep_to_the_token_bound():
    """Many API keys: the stores' tokens together stay within --suffix-cache-tokens, the least recently
    used stores forgotten whole."""
    p = SuffixProposer(order=3, cache_tokens=60, budget=6, width=2)
    for k in range(10):
        seq = SequenceGroup("r", [1, 2], SamplingParams(tenant=f"key-{k}"), 0.0).seqs[0]
        seq.token_ids += list(range(3, 23))  # a 20-token output
        seq.finish_reason = FinishReason.LENGTH
        p.on_free(seq)
        assert sum(st.num_tokens for st in p.stores.values()) <= 60
    assert [key[1] for key in p.stores] == ["key-7", "key-8", "key-9"]
