"""Self-speculative decoding by layer skipping: the skip plan, greedy identity through the engine
(chains and trees, under preemption), the target's distribution under sampling with a failing wrong
rule, and a draft that shares the target's weights and cache."""

from __future__ import annotations

import json

import pytest
import torch
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair, wrong_residual  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts

from conftest import build_model_dir
from engine.models.layer_skip import LayerSkip
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny steps (see conftest)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(
        tmp_path_factory.mktemp("layer-skip") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3, num_hidden_layers=4
    )


def write_skip(tmp_path, skip: LayerSkip) -> str:
    path = tmp_path / "skip.json"
    path.write_text(json.dumps(skip.to_dict()))
    return str(path)


def test_skip_plan_round_trips_and_is_checked(tmp_path):
    skip = LayerSkip(frozenset({1, 2}), frozenset({2}))
    assert LayerSkip.load(write_skip(tmp_path, skip)) == skip
    assert LayerSkip.middle(8) == LayerSkip(frozenset(range(2, 6)), frozenset(range(2, 6)))
    assert LayerSkip.middle(2) == LayerSkip()  # too few layers to skip any by default
    with pytest.raises(ValueError, match="layers"):
        LayerSkip(frozenset({5})).check(4)
    with pytest.raises(ValueError, match="every sublayer"):
        LayerSkip(frozenset(range(2)), frozenset(range(2))).check(2)


def test_a_skipped_forward_is_the_model_without_those_sublayers(target):
    eng = make(target)
    runner = eng.runner
    chunk = [ForwardChunk([5, 6, 7, 8], 0, [1, 2], 4)]
    full = runner.forward(chunk).logits
    assert torch.equal(runner.forward(chunk, skip=LayerSkip()).logits, full)
    skipped = runner.forward(chunk, skip=LayerSkip(frozenset({1}), frozenset({2}))).logits
    assert not torch.allclose(skipped, full)
    # By hand: the same layers with attention 1 and MLP 2 left out.
    model = runner.model
    for layer in (model.layers[1].self_attn, model.layers[2].mlp):
        original = layer.forward
        layer.forward = lambda *a, _o=original, **k: torch.zeros_like(_o(*a, **k))
    try:
        torch.testing.assert_close(runner.forward(chunk).logits, skipped)
    finally:
        del model.layers[1].self_attn.forward, model.layers[2].mlp.forward


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_output_is_the_plain_decoders(target, tmp_path, topk):
    prompts = repetitive_prompts(8, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    config = write_skip(tmp_path, LayerSkip(frozenset({1, 2}), frozenset({2})))
    eng = make(
        target, "layer-skip", layer_skip_config=config, spec_tree_topk=topk, num_kv_blocks=48, max_num_batched_tokens=40
    )
    assert eng.proposer.kv_bytes_per_token == 0 and eng.proposer.runner is eng.runner  # shares the target
    pinned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts, pinned)] == plain
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk):  # noqa: F811
    target_dir, _ = small_vocab_pair
    skip_json = write_skip(tmp_path, LayerSkip(frozenset({1}), frozenset()))  # a 2-layer target
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 5]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = dict(layer_skip_config=skip_json, spec_tree_topk=topk)
    stat, dof = g_statistic(
        samples(target_dir, params, prompt, n, "layer-skip", **kw),
        expected,
        n,
    )
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    wrong_residual(monkeypatch)  # sampled chains' and top-k trees' rejected drafts left in p
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "layer-skip", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"
