"""Lookahead decoding: the window's layout, the n-gram pool, the window's outputs equal to the
target's own continuation of each trajectory, and exactness through the engine (greedy identity
under preemption, prefix reuse and n > 1; the sampled distribution, with a wrong rule failing)."""

from __future__ import annotations

import pytest
from test_ngram import samples, target  # noqa: F401
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import check_n_choices, make
from test_step import prompts as repetitive_prompts

import engine.sampling.verify as verify_mod
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods.lookahead import LookaheadProposer, window_layout, window_rows
from engine.speculative.ngram_pool import NgramPool


def test_the_window_layout_is_one_trajectory_per_row():
    # W = 3, N = 3: level 0 feeds columns 1, 2 (a1, a2); level 1 feeds columns 0, 1, 2 (b0, b1, b2).
    cells, offsets, mask = window_layout(levels=2, width=3)
    assert cells == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert offsets == [1, 2, 1, 2, 3]
    a1, a2, b0, b1, b2 = range(5)
    sees = {r: {c for c in range(5) if mask[r, c]} for r in range(5)}
    assert sees == {a1: {a1}, a2: {a1, a2}, b0: {b0}, b1: {a1, b1}, b2: {a1, a2, b2}}
    assert window_rows(2, 3) == len(cells)
    # Every row sees a run of consecutive positions past the root (the root itself is always seen).
    cells, offsets, mask = window_layout(levels=4, width=5)
    for r, off in enumerate(offsets):
        assert sorted(offsets[c] for c in range(len(cells)) if mask[r, c]) == list(range(1, off + 1))


def test_the_pool_is_bounded_and_its_trie_is_newest_first():
    pool = NgramPool(n=4, per_key=3, max_keys=2)
    for gram in [(1, 2, 3), (1, 2, 4), (5, 6, 7), (1, 9, 9)]:
        pool.add(0, gram)
    assert list(pool.grams[0]) == [(1, 2, 4), (5, 6, 7), (1, 9, 9)]  # the oldest went
    pool.add(0, (1, 2, 4))  # seen again: the newest
    tree = pool.tree(0, depth=2, limit=3)
    # Newest first: (1, 2, 4) then (1, 9, 9) share their first token; (5, 6, 7) after them.
    assert tree.tokens == [1, 2, 9, 5, 6] and tree.parents == [-1, 0, 0, -1, 3]
    assert pool.tree(0, depth=3, limit=1).tokens == [1, 2, 4]
    assert pool.tree(7, depth=3, limit=3).tokens == []
    pool.add(1, (0, 0, 0))
    pool.add(2, (0, 0, 0))  # a third key: the least recently touched (0) goes
    assert sorted(pool.grams) == [1, 2]
    # Text: every n-gram whose tokens are all there, and where to go on from.
    text = NgramPool(n=3, per_key=4, max_keys=8)
    assert text.add_text([1, 2, 3, 1, 2, 4], 0) == 4
    assert {k: list(v) for k, v in text.grams.items()} == {1: [(2, 3), (2, 4)], 2: [(3, 1)], 3: [(1, 2)]}


def test_the_window_guesses_what_the_target_says_after_each_trajectory(target):  # noqa: F811
    """Each window row's output is the target's greedy next token after the context, the root and the
    trajectory the row sees (its mask, in position order): what a plain forward over that text gives.
    So positions, the mask and the rows' KV are right, and the tree's rows do not leak into them."""
    eng = make(target, "lookahead", lookahead_window=3, lookahead_ngram=4, num_speculative_tokens=3)
    proposer: LookaheadProposer = eng.proposer
    fed, seen = {}, []
    extra_rows, on_verify_logits = proposer.extra_rows, proposer.on_verify_logits

    def spy_rows(seq, tree, slots):
        extra = extra_rows(seq, tree, slots)
        fed[seq.seq_id] = list(seq.token_ids)  # the context, the root last
        return extra

    def spy_logits(rows, logits):
        for r in rows:
            first, extra = r.extra_row, r.extra
            seen.append((fed[r.seq.seq_id], extra, logits[first : first + len(extra)].argmax(-1).tolist()))
        on_verify_logits(rows, logits)

    proposer.extra_rows, proposer.on_verify_logits = spy_rows, spy_logits
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3))
    assert len(seen) >= 3, "the window rode in the verify forwards"
    plain = make(target)
    texts, outs = [], []
    for context, extra, out in seen[:4]:
        for r in range(len(extra)):
            seen_rows = sorted((extra.offsets[c], extra.tokens[c]) for c in range(len(extra)) if extra.mask[r, c])
            texts.append(context + [t for _, t in seen_rows])
            outs.append(out[r])
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    assert [o.outputs[0].delta_token_ids[0] for o in plain.generate(texts, greedy)] == outs


@pytest.mark.parametrize("shared", [False, True])
def test_greedy_output_is_the_plain_decoders(target, shared):  # noqa: F811
    # (seed 5: prompts on which the random model repeats itself, so that the pools have something to find)
    prompts = repetitive_prompts(10, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    # A small pool: preemption too; prefix caching is on (the default) and the prompts repeat.
    eng = make(target, "lookahead", num_kv_blocks=48, max_num_batched_tokens=64, lookahead_shared=shared)
    pinned = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts + prompts[:3], pinned)] == plain + plain[:3]
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, "repetitive text: the pool must be right sometimes"
    assert eng.proposer.num_window_grams > 0, "the window's trajectories went into the pool"
    assert eng.controller.max_depth == eng.proposer.D == 3, "the controller plans no deeper than an n-gram reaches"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, "the window's slots came back"
    assert not eng.proposer._windows and not eng.proposer._pools, "finished sequences leave no state behind"


def test_shared_pools_are_one_per_tenant(target):  # noqa: F811
    """--lookahead-shared pools one prompt family's n-grams, within one API key and adapter: the same
    prompt under two keys gets two pools, and the greedy tokens stay the plain decoder's."""
    prompts = repetitive_prompts(1, seed=5) * 2
    eng = make(target, "lookahead", lookahead_shared=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3, tenant=t)
        for t in ("key-a", "key-b")
    ]
    outs = [o.outputs[0].delta_token_ids for o in eng.generate(prompts, params)]
    plain = make(target).generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert outs == [plain[0].outputs[0].delta_token_ids] * 2
    assert sorted(key[0] for key in eng.proposer._families) == [(None, "key-a"), (None, "key-b")]


def test_n_choices_fork_the_window(target):  # noqa: F811
    check_n_choices(make(target), make(target, "lookahead"))


def test_sampled_output_keeps_the_targets_distribution_and_a_wrong_rule_fails(small_vocab_pair, monkeypatch):  # noqa: F811
    target_dir, _ = small_vocab_pair
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, num_draft_tokens=3)
    # After 3 the prompt has 4, 5, 6 and 7, after 7 it has 3, 4, 5 and 6: the tries branch.
    prompt = [0, 3, 4, 3, 5, 3, 4, 3, 6, 3, 7, 3, 7, 4, 7, 5, 7, 6, 7, 3]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = {"lookahead_window": 2, "lookahead_ngram": 3, "lookahead_guesses": 3, "max_num_batched_tokens": 16384}
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "lookahead", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    monkeypatch.setattr(verify_mod, "drop_token", lambda P_, x_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "lookahead", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_the_window_narrows_with_the_depth():
    p = LookaheadProposer(window=4, ngram=4, guesses=4, max_depth=4)
    assert p.D == 3  # an n-gram of 4 drafts at most 3 tokens after its key
    assert [p.width(d) for d in range(4)] == [0, 2, 3, 4]
    assert p.slots_needed(0) == 0
    assert p.slots_needed(3) == 4 * 3 + window_rows(3, 4)
    assert p.slots_needed(1) == 4 + window_rows(3, 2) < p.slots_needed(2) < p.slots_needed(3)
    assert len(window_layout(3, 2)[0]) == window_rows(3, 2) == 5  # the rows slots_needed counts are fed
