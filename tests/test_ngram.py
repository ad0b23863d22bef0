"""Prompt lookup (``--speculative-method ngram``): the search itself, greedy identity through the engine,
the target's distribution under sampling (with a wrong rule failing), and no draft work without a hit."""

from __future__ import annotations

import numpy as np
import pytest
from test_spec import exact_joint, g_statistic, g_test_threshold, sample_counts, small_vocab_pair  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.config import EngineConfig
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods.ngram import NgramProposer, find_continuation


def test_find_continuation_prefers_the_longest_then_the_latest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 3], dtype=np.int32)
    # Suffix [3] occurs at 2 and 6: the latest (6) wins; what followed it: 4, 5.
    assert find_continuation(t, 1, 3, 2) == [4, 5]
    t = np.array([5, 6, 7, 8, 0, 6, 7, 1, 5, 6, 7], dtype=np.int32)
    # [5, 6, 7] occurs once earlier (at 0): the 3-gram beats the later 2-gram [6, 7] at 5.
    assert find_continuation(t, 1, 3, 3) == [8, 0, 6]
    assert find_continuation(t, 4, 4, 3) == []  # no 4-gram repeats
    assert find_continuation(np.array([4], dtype=np.int32), 1, 3, 3) == []
    assert find_continuation(np.array([4, 4], dtype=np.int32), 1, 3, 5) == [4]  # the draft stops at the end


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("ngram") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3)


def test_greedy_output_is_the_plain_decoders(target):
    prompts = repetitive_prompts(10, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    eng = make(target, "ngram", num_kv_blocks=48, max_num_batched_tokens=40)  # small pool: preemption too
    pinned = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=4)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts, pinned)] == plain
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, "repetitive text: lookup must be right sometimes"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.proposer._tokens, "finished sequences leave no lookup state behind"


def test_a_request_whose_lookup_finds_nothing_costs_no_draft_work(target):
    eng = make(target, "ngram", num_speculative_tokens=3)
    # All-distinct tokens, and greedy continuations of a random model rarely repeat within 6 tokens.
    prompt = list(range(10, 40))
    params = SamplingParams(temperature=0.0, max_tokens=1, num_draft_tokens=3)
    eng.generate([prompt], params)
    assert eng.spec_stats.num_drafts == 0 and eng.spec_stats.num_draft_tokens == 0


def samples(target, params: SamplingParams, prompt: list[int], n: int, method: str = "ngram", **kw) -> dict:
    """The first 3 tokens of ``n`` sampled continuations of ``prompt``, counted, through ``method``."""
    eng = make(target, method, num_kv_blocks=4096, max_num_seqs=1024, block_size=8, **kw)
    counts = sample_counts(eng, params, prompt, n)
    assert eng.spec_stats.num_drafts > 0 and eng.spec_stats.num_accepted_tokens > 0
    return counts


def test_sampling_keeps_the_targets_distribution_and_a_wrong_rule_fails(small_vocab_pair, monkeypatch):  # noqa: F811
    target, _ = small_vocab_pair
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 3, 4, 3]  # an 8-token vocabulary: lookup drafts nearly every step
    n = 12_800
    expected = exact_joint(target, prompt, params)
    stat, dof = g_statistic(samples(target, params, prompt, n), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    # Wrong: after rejecting a deterministic draft, resample from p without removing the draft token.
    monkeypatch.setattr(verify_mod, "drop_token", lambda P_, x_: P_)
    stat, dof = g_statistic(samples(target, params, prompt, n), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_bad_ngram_settings_are_refused():
    with pytest.raises(ValueError, match="ngram"):
        EngineConfig(model="m", speculative_method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
