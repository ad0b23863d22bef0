"""Chained (MTP) heads: their directory loads and a broken one is a start-up error naming the tensor;
each head really reads the previous head's output and the drafted token; greedy identity through the
engine (chains and dynamic trees, under preemption); the target's distribution under sampling, with a
wrong rule failing; self-distillation on a tiny target accepting more than the untrained start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle import check_training_beats_start
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts
from transformers import AutoConfig

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.offline.train_draft import TrainConfig
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods import resolve_method
from engine.speculative.methods.mtp import ChainedHeads, load_chained_heads


def write_heads(target, path: Path, num_heads=3, num_layers=1, std=0.3) -> Path:
    cfg = AutoConfig.from_pretrained(target)
    torch.manual_seed(2)
    heads = ChainedHeads(cfg.hidden_size, num_heads, num_layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, std)
        for head in heads.heads:
            head.hidden_norm.weight.fill_(1.0)
            head.embed_norm.weight.fill_(1.0)
    heads.save(path)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("mtp") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3)


def test_the_directory_loads_and_heads_chain(target, tmp_path):
    d = write_heads(target, tmp_path / "heads", num_heads=2, num_layers=2)
    assert resolve_method(None, str(d)) == "mtp"
    hidden = AutoConfig.from_pretrained(target).hidden_size
    heads = load_chained_heads(d, hidden, torch.float32, torch.device("cpu"))
    assert (heads.num_heads, heads.num_layers) == (2, 2)
    s, e = torch.randn(3, hidden), torch.randn(3, hidden)
    # Head 1 by hand: [norm(s); norm(e)] projected, then two residual blocks.
    w = load_file(d / "mtp_heads.safetensors")
    norm = lambda x, g: g * torch.nn.functional.rms_norm(x, (hidden,), eps=1e-6)  # noqa: E731
    y = torch.cat([norm(s, w["1.hidden_norm.weight"]), norm(e, w["1.embed_norm.weight"])], -1) @ w["1.proj.weight"].T
    for j in range(2):
        y = y + torch.nn.functional.silu(y @ w[f"1.blocks.{j}.linear.weight"].T + w[f"1.blocks.{j}.linear.bias"])
    torch.testing.assert_close(heads.heads[1](s, e), y)
    # The state and the token both matter (a chain, not independent heads).
    assert not torch.allclose(heads.heads[1](s, e), heads.heads[1](s, e.roll(1, 0)))
    assert not torch.allclose(heads.heads[1](s, e), heads.heads[1](s.roll(1, 0), e))


def test_a_broken_directory_is_a_startup_error_naming_the_tensor(target, tmp_path):
    d = write_heads(target, tmp_path / "heads")
    hidden = AutoConfig.from_pretrained(target).hidden_size
    w = load_file(d / "mtp_heads.safetensors")
    save_file({k: v for k, v in w.items() if k != "2.proj.weight"}, d / "mtp_heads.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 2\.proj\.weight"):
        load_chained_heads(d, hidden, torch.float32, torch.device("cpu"))
    w["0.blocks.0.linear.bias"] = torch.zeros(hidden + 1)
    save_file(w, d / "mtp_heads.safetensors")
    with pytest.raises(ValueError, match=r"0\.blocks\.0\.linear\.bias has shape"):
        load_chained_heads(d, hidden, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="missing tensor|has shape"):
        make(target, "mtp", draft_model=str(d))


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_output_is_the_plain_decoders(target, tmp_path, topk):
    d = write_heads(target, tmp_path / "heads")
    ps = repetitive_prompts(8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    eng = make(target, None, draft_model=str(d), spec_tree_topk=topk, num_kv_blocks=48, max_num_batched_tokens=40)
    assert eng.spec_method == "mtp"
    pinned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk):  # noqa: F811
    target_dir, _ = small_vocab_pair
    d = write_heads(target_dir, tmp_path / "heads", std=0.5)
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True, num_draft_tokens=2)
    prompt = [0, 3, 4, 5]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = dict(draft_model=str(d), spec_tree_topk=topk)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "mtp", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "mtp", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_self_distillation_accepts_more_than_the_untrained_start(target, tmp_path):
    cfg = TrainConfig(method="mtp", num_heads=3, gen_tokens=40, steps=600, batch_size=256, lr=3e-3, save_every=300)
    check_training_beats_start(target, tmp_path, cfg, depths=3)
