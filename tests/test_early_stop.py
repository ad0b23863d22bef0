"""Draft & Verify early stopping: the adaptive threshold, drafts cut where the drafter is unsure with
greedy output still the plain decoder's (layer skipping and a draft model, chains and trees), and the
target's distribution kept under sampling (with a wrong rule failing)."""

from __future__ import annotations

import json

import pytest
import torch
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, noisy_copy, small_vocab_pair, wrong_residual  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts

import engine.speculative.methods.layer_skip as layer_skip_mod
from conftest import build_model_dir
from engine.models.layer_skip import LayerSkip
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk
from engine.speculative.early_stop import EarlyStop, draft_confidence
from engine.speculative.methods.draft_model import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny steps (see conftest)


def test_the_threshold_follows_acceptance_per_kind_of_request():
    es = EarlyStop(0.7, start=0.3, step=0.05)
    for _ in range(5):
        es.observe(True, 4, 0)  # greedy drafts rejected: draft only what the drafter is sure of
    assert es.gamma[True] > 0.3 and es.gamma[False] == 0.3
    for _ in range(200):
        es.observe(True, 4, 0)
    assert es.gamma[True] == es.ceiling < 1.0  # never so high that nothing is ever drafted
    for _ in range(200):
        es.observe(True, 4, 4)  # all accepted: draft deeper
    assert es.gamma[True] == 0.0
    es.observe(False, 0, 0)  # an empty draft says nothing
    assert es.gamma[False] == 0.3
    with pytest.raises(ValueError, match="target"):
        EarlyStop(1.0)


def test_confidence_is_the_top_probability_of_what_the_row_drafts_from():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.5, 0.3]])  # row 0 greedy (one-hot q), row 1 sampled
    conf = draft_confidence(logits, q, [True, False])
    torch.testing.assert_close(conf, torch.stack([torch.softmax(logits[0], -1).max(), torch.tensor(0.5)]))


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(
        tmp_path_factory.mktemp("early-stop") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3, num_hidden_layers=4
    )


def median_confidence(runner, ps: list[list[int]], skip: LayerSkip | None = None) -> float:
    """The drafter's median top-1 probability over the prompts: a threshold that cuts about half the levels."""
    top = []
    for i, p in enumerate(ps):
        out = runner.forward([ForwardChunk(p, 0, list(range(i * 8, i * 8 + 8)), len(p))], skip=skip)
        top.append(torch.softmax(out.logits, -1).amax(-1))
    return torch.cat(top).median().item()


@pytest.mark.parametrize("method", ["layer-skip", "draft"])
@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_drafts_cut_short_keep_the_plain_decoders_output(target, tmp_path, method, topk):
    ps = repetitive_prompts(8, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=4)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    skip = LayerSkip(frozenset({1, 2}), frozenset({2}))
    (tmp_path / "skip.json").write_text(json.dumps(skip.to_dict()))
    if method == "layer-skip":
        kw = dict(layer_skip_config=str(tmp_path / "skip.json"))
    else:
        kw = dict(draft_model=str(noisy_copy(target, tmp_path / "draft", 0.3)))
    runs = {}
    for stop in (0.0, 0.7):
        eng = make(target, method, spec_tree_topk=topk, spec_early_stop=stop, num_kv_blocks=64, **kw)
        if stop:  # a fixed threshold in the middle of the drafter's confidences: some levels stop, some go on
            runner = eng.runner if method == "layer-skip" else eng.proposer.runner
            gamma = median_confidence(runner, ps, skip if method == "layer-skip" else None)
            eng.proposer.early_stop = EarlyStop(0.7, start=gamma, step=0.0)
        else:
            assert eng.proposer.early_stop is None
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        runs[stop] = (eng.proposer.num_forwards, eng.spec_stats)
    (cut_forwards, cut), (full_forwards, full) = runs[0.7], runs[0.0]
    assert cut.num_drafts > 0 and cut.num_accepted_tokens > 0
    assert cut_forwards < full_forwards, "unsure levels must not be drafted"
    assert cut.num_draft_tokens / cut.num_drafts < full.num_draft_tokens / full.num_drafts


def test_a_threshold_at_its_ceiling_still_learns(target, tmp_path):
    """The first level is always drafted, so even a threshold that cuts every later level hears of
    acceptance and comes down when drafts are good (here the draft is the target: skip nothing)."""
    (tmp_path / "skip.json").write_text(json.dumps(LayerSkip().to_dict()))
    eng = make(target, "layer-skip", layer_skip_config=str(tmp_path / "skip.json"))
    eng.proposer.early_stop = EarlyStop(0.7, start=0.95)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=4)
    eng.generate(repetitive_prompts(4, seed=2), params)
    assert eng.spec_stats.num_accepted_tokens > 0
    assert eng.proposer.early_stop.gamma[True] == 0.0


def test_the_method_defaults(target, tmp_path):
    (tmp_path / "skip.json").write_text(json.dumps(LayerSkip(frozenset({1})).to_dict()))
    eng = make(target, "layer-skip", layer_skip_config=str(tmp_path / "skip.json"))
    assert eng.proposer.early_stop is not None and eng.proposer.early_stop.target == 0.7
    eng = make(target, "draft", draft_model=str(target))
    assert eng.proposer.early_stop is None
    assert make(target, "draft", draft_model=str(target), spec_early_stop=0.5).proposer.early_stop.target == 0.5


GAMMA = 0.8  # about the median of the layer-skip draft's top-1 probabilities here: a mix of stops and levels


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk):  # noqa: F811
    target_dir, _ = small_vocab_pair
    # 4 tokens, the first 3 counted: the second step may draft 2 levels, and its confidences vary.
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 5, 6, 7, 3]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    (tmp_path / "skip.json").write_text(json.dumps(LayerSkip(frozenset({1})).to_dict()))  # a 2-layer target
    # A fixed threshold: many drafts end early, at a level the drafter's own confidence chooses.
    monkeypatch.setattr(layer_skip_mod, "early_stop_for", lambda config, default: EarlyStop(0.7, GAMMA, step=0.0))
    rows = [0, 0]  # rows stopped, rows asked past the first level (the real method runs; this only counts)
    sure = DraftModelProposer._sure

    def counted(self, logits, q, greedy):
        kept = sure(self, logits, q, greedy)
        rows[0], rows[1] = rows[0] + len(greedy) - len(kept), rows[1] + len(greedy)
        return kept

    monkeypatch.setattr(DraftModelProposer, "_sure", counted)
    kw = dict(layer_skip_config=str(tmp_path / "skip.json"), spec_tree_topk=topk)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "layer-skip", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    assert 100 < rows[0] < rows[1], f"drafts must really have been cut short, and not all: {rows}"
    wrong_residual(monkeypatch)  # sampled chains' and top-k trees' rejected drafts left in p
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "layer-skip", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"
