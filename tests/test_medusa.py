"""Medusa heads: the published checkpoint layout (loaded, and refused with a clear error when a tensor
is missing or misshapen), best-first trees, greedy identity through the engine (chains and trees, under
preemption), the target's distribution under sampling with a wrong rule failing, and self-distillation
on the tiny demo improving the heads over their untrained start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts
from transformers import AutoConfig

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.config import EngineConfig
from engine.offline.train_draft import TrainConfig, train_draft
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods import resolve_method
from engine.speculative.methods.medusa import MedusaHeads, best_first_tree, load_medusa


def write_heads(target, path, num_heads=3, num_layers=1, fmt="safetensors", std=0.3, like_target=False) -> Path:
    """Random heads for ``target`` in Medusa's published layout (``{i}.{j}.linear.*``, ``{i}.{n}.weight``);
    ``like_target``: every head drafts one fixed token whatever the state (its residual block adds a large
    constant; its output layer is the target's), a token the target often says: drafts right and wrong."""
    cfg = AutoConfig.from_pretrained(target)
    torch.manual_seed(1)
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    for p in heads.parameters():
        torch.nn.init.normal_(p, 0.0, std)
    if like_target:
        w = load_file(Path(target) / "model.safetensors")
        out = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(out)
                head[0].linear.weight.zero_()
                head[0].linear.bias.copy_(30 * out[4] / out[4].norm())
    path.mkdir(parents=True, exist_ok=True)
    state = heads.heads.state_dict()
    assert {"0.0.linear.weight", "0.0.linear.bias", f"0.{num_layers}.weight"} <= set(state)
    if fmt == "safetensors":
        save_file(state, path / "medusa_lm_head.safetensors")
    else:
        torch.save(state, path / "medusa_lm_head.pt")
    cfg_json = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "x"}
    (path / "config.json").write_text(json.dumps(cfg_json))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("medusa") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_published_layout_loads(target, tmp_path, fmt):
    d = write_heads(target, tmp_path / "heads", num_heads=2, num_layers=2, fmt=fmt)
    cfg = AutoConfig.from_pretrained(target)
    heads = load_medusa(d, cfg.hidden_size, cfg.vocab_size, torch.float32, torch.device("cpu"))
    assert (heads.num_heads, heads.num_layers) == (2, 2)
    x = torch.randn(3, cfg.hidden_size)
    assert heads(x).shape == (3, 2, cfg.vocab_size)
    # Head 1 by hand: two residual blocks, then the output layer.
    state = heads.heads.state_dict()
    y = x
    for j in range(2):
        y = y + torch.nn.functional.silu(y @ state[f"1.{j}.linear.weight"].T + state[f"1.{j}.linear.bias"])
    torch.testing.assert_close(heads(x)[:, 1], y @ state["1.2.weight"].T)


def test_a_broken_checkpoint_is_a_startup_error_naming_the_tensor(target, tmp_path):
    cfg = AutoConfig.from_pretrained(target)
    d = write_heads(target, tmp_path / "heads")
    w = load_file(d / "medusa_lm_head.safetensors")
    missing = {k: v for k, v in w.items() if k != "1.0.linear.bias"}
    save_file(missing, d / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 1\.0\.linear\.bias"):
        load_medusa(d, cfg.hidden_size, cfg.vocab_size, torch.float32, torch.device("cpu"))
    w["2.1.weight"] = torch.zeros(cfg.vocab_size + 5, cfg.hidden_size)
    save_file(w, d / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"2\.1\.weight has shape"):
        load_medusa(d, cfg.hidden_size, cfg.vocab_size, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="missing tensor|has shape"):  # through the engine, at start-up
        make(target, "medusa", draft_model=str(d))


def test_best_first_tree_keeps_the_likeliest_paths():
    # Level 0: a (p .6), b (.3); level 1: c (.9), d (.1) under every node.
    lp = [[0.6, 0.3], [0.9, 0.1]]
    logp = [[float(torch.tensor(p).log()) for p in row] for row in lp]
    tree = best_first_tree(logp, [[10, 11], [20, 21]], depth=2, budget=4)
    # Paths by probability: a .6, a-c .54, b .3, b-c .27, a-d .06 ...
    assert (tree.tokens, tree.parents) == ([10, 20, 11, 20], [-1, 0, -1, 2])
    assert best_first_tree(logp, [[10, 11], [20, 21]], depth=1, budget=4).tokens == [10, 11]


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_output_is_the_plain_decoders(target, tmp_path, topk):
    heads = write_heads(target, tmp_path / "heads")
    assert resolve_method(None, str(heads)) == "medusa"
    ps = repetitive_prompts(8, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    eng = make(target, None, draft_model=str(heads), spec_tree_topk=topk, num_kv_blocks=48, max_num_batched_tokens=40)
    assert eng.spec_method == "medusa"
    pinned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk):  # noqa: F811
    target_dir, _ = small_vocab_pair
    heads = write_heads(target_dir, tmp_path / "heads", std=0.5, like_target=True)
    # 4 tokens, the first 3 counted: the second step drafts 2 levels.
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True, num_draft_tokens=2)
    prompt = [0, 3, 4, 5]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = dict(draft_model=str(heads), spec_tree_topk=topk)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "medusa", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    # A wrong rule: after a rejection, sample from p again, not from the residual without the rejected
    # (one-hot) drafts.
    monkeypatch.setattr(verify_mod, "drop_token", lambda P_, x_: P_)
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "medusa", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_self_distillation_improves_the_heads(target, tmp_path):
    config = EngineConfig(model=str(target), device="cpu", compile="off", num_kv_blocks=256, block_size=8)
    # A random-weight target with peaked distributions (the tiny demo is too little trained to have any:
    # its next-token distributions are nearly flat, so there is nothing for heads to learn).
    prompts = [" ".join(str(i * j % 97) for j in range(3, 12)) for i in range(1, 25)]
    cfg = TrainConfig(num_heads=2, gen_tokens=40, steps=600, batch_size=128, lr=3e-3, save_every=300)
    out = tmp_path / "medusa"
    report = train_draft(config, out, prompts, cfg, progress=False)
    before, after = report["heldout_before"], report["heldout_after"]
    # Every head is closer to the target than at its start (a copy of the target's output layer).
    assert all(a < b for a, b in zip(after["kl"], before["kl"])), report
    assert json.loads((out / "report.json").read_text())["heldout_after"] == after
    # Resumable: a finished run resumes at its last step and trains no further.
    again = train_draft(config, out, prompts, cfg, resume=True, progress=False)
    assert again["heldout_before"] == before and again["heldout_after"] == after
    # The directory serves, drafting with it is exact, and the trained heads accept more than untrained
    # ones (the same layout at the start of training: copies of the target's output layer).
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=2)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    accepted = {}
    start = MedusaHeads(*_shape(target), num_heads=2)
    with torch.no_grad():
        w = load_file(Path(target) / "model.safetensors")
        for head in start.heads:
            head[-1].weight.copy_(w.get("lm_head.weight", w["model.embed_tokens.weight"]))
            head[0].linear.weight.zero_()
            head[0].linear.bias.zero_()
    start.save(tmp_path / "untrained")
    for name, d in (("trained", out), ("untrained", tmp_path / "untrained")):
        eng = make(target, None, draft_model=str(d))
        assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts, params)] == plain
        accepted[name] = eng.spec_stats.num_accepted_tokens
    assert accepted["trained"] > accepted["untrained"], accepted


def _shape(target) -> tuple[int, int]:
    cfg = AutoConfig.from_pretrained(target)
    return cfg.hidden_size, cfg.vocab_size
