"""EAGLE-style heads: EAGLE-3's and the speculators format's published layouts (loaded, with a reduced
draft vocabulary mapped to the target's ids; refused with a clear error when a tensor is missing or
misshapen), greedy identity through the engine (chains and dynamic trees, under preemption and prefix
reuse), the target's distribution under sampling with a wrong rule failing, and self-distillation
on a tiny target accepting more than the untrained start."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts
from transformers import AutoConfig, LlamaConfig

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.config import EngineConfig
from engine.offline.train_draft import TrainConfig, train_draft
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods import resolve_method
from engine.speculative.methods.eagle import EagleHead, load_eagle


def random_head(
    target, draft_vocab: int | None = None, aux=(1, 2), std=0.3, seed=1, **layer
) -> tuple[EagleHead, list[int]]:
    """A random EAGLE head for ``target`` (feature layers ``aux``, Hugging Face indices); a reduced
    draft vocabulary keeps every other target id, so ``d2t`` really maps. ``layer``: more of the
    layer's config (``attention_bias``, ``mlp_bias``)."""
    cfg = AutoConfig.from_pretrained(target)
    layer = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        **layer,
    )
    dv = draft_vocab or cfg.vocab_size
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    torch.manual_seed(seed)
    head = EagleHead(layer, len(aux), cfg.hidden_size, dv, embed, 512)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens"):
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.05 if p.dim() == 1 else std)
        if dv < cfg.vocab_size:
            ids = torch.arange(0, 2 * dv, 2).clamp(max=cfg.vocab_size - 1)
            head.d2t.copy_(ids - torch.arange(dv))
            head.t2d.zero_().index_fill_(0, ids, True)
    head.init_buffers()
    return head, list(aux)


def write_eagle(target, path: Path, layout="eagle3", fmt="safetensors", **kw) -> Path:
    """A random head saved in EAGLE-3's layout, or rewritten into the speculators format."""
    head, aux = random_head(target, **kw)
    head.save(path, aux)
    if fmt == "pt":
        torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    if layout == "speculators":
        cfg = json.loads((path / "config.json").read_text())
        layer = {k: v for k, v in cfg.items() if k not in ("eagle_config", "draft_vocab_size", "architectures")}
        spec = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": aux,
        }
        (path / "config.json").write_text(json.dumps(spec))
        w = load_file(path / "model.safetensors")
        w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        w["embed_tokens.weight"] = torch.randn(AutoConfig.from_pretrained(target).vocab_size, head.config.hidden_size)
        save_file(w, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("eagle") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3)


def _load(target, d):
    cfg = AutoConfig.from_pretrained(target)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return load_eagle(d, cfg, embed, torch.float32, torch.device("cpu"), 512)


@pytest.mark.parametrize("layout,fmt", [("eagle3", "safetensors"), ("eagle3", "pt"), ("speculators", "safetensors")])
def test_published_layouts_load(target, tmp_path, layout, fmt):
    d = write_eagle(target, tmp_path / "head", layout, fmt, draft_vocab=40)
    assert resolve_method(None, str(d)) == "eagle"
    head, aux = _load(target, d)
    assert aux == [1, 2]
    if fmt == "safetensors":
        saved = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(d / "model.safetensors").items()}
    else:
        saved = torch.load(d / "pytorch_model.bin", weights_only=True)
    for name, t in head.checkpoint_state().items():  # every tensor landed where its name says
        torch.testing.assert_close(t, saved[name].to(t.dtype), msg=name)
    if layout == "speculators":  # it brings its own embedding table
        torch.testing.assert_close(head.embed_tokens.weight, saved["embed_tokens.weight"])
    # The reduced vocabulary: draft id i is target id 2i; other ids can never be drafted.
    x = torch.randn(3, head.config.hidden_size)
    logits = head.compute_logits(x)
    assert logits.shape == (3, AutoConfig.from_pretrained(target).vocab_size)
    finite = torch.isfinite(logits[0]).nonzero().flatten()
    assert finite.tolist() == list(range(0, 80, 2))
    torch.testing.assert_close(logits[:, finite], head.lm_head(x))


def test_a_head_with_biases_loads_them(target, tmp_path):
    """attention_bias and mlp_bias: the q/k/v, o, gate/up and down biases are saved and loaded under
    their own names (not left as nn.Linear's random start), and a missing one is named."""
    d = write_eagle(target, tmp_path / "head", attention_bias=True, mlp_bias=True)
    saved = load_file(d / "model.safetensors")
    biases = [n for n in saved if n.endswith(".bias")]
    assert len(biases) == 7
    head, _ = _load(target, d)
    state = head.checkpoint_state()
    for name in biases:
        torch.testing.assert_close(state[name], saved[name], msg=name)
    save_file({k: v for k, v in saved.items() if k != "midlayer.mlp.down_proj.bias"}, d / "model.safetensors")
    with pytest.raises(ValueError, match="midlayer.mlp.down_proj.bias"):
        _load(target, d)


def test_a_broken_checkpoint_is_a_startup_error_naming_the_tensor(target, tmp_path):
    d = write_eagle(target, tmp_path / "head")
    w = load_file(d / "model.safetensors")
    save_file({k: v for k, v in w.items() if k != "midlayer.hidden_norm.weight"}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor midlayer\.hidden_norm\.weight"):
        _load(target, d)
    w["fc.weight"] = torch.zeros(w["fc.weight"].shape[0], 3 * w["fc.weight"].shape[0])  # 3 layers, config says 2
    save_file(w, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc\.weight has shape"):
        _load(target, d)
    with pytest.raises(ValueError, match="missing tensor|has shape"):  # through the engine, at start-up
        make(target, "eagle", draft_model=str(d))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match="speculators_model_type 'eagle' is not supported"):
        _load(target, d)


@pytest.mark.parametrize("topk,draft_vocab", [(1, None), (2, None), (2, 40)], ids=["chains", "trees", "reduced-vocab"])
def test_greedy_output_is_the_plain_decoders(target, tmp_path, topk, draft_vocab):
    d = write_eagle(target, tmp_path / "head", draft_vocab=draft_vocab)
    ps = repetitive_prompts(8, seed=4)
    ps += [ps[0] + [5, 6, 7, 8, 9, 10], ps[0] + [11, 12]]  # a shared prefix: the second reuses cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    eng = make(target, None, draft_model=str(d), spec_tree_topk=topk, num_kv_blocks=48, max_num_batched_tokens=40)
    assert eng.spec_method == "eagle"
    pinned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("topk,draft_vocab", [(1, None), (2, 4)], ids=["chains", "trees-reduced-vocab"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk, draft_vocab):  # noqa: F811
    target_dir, _ = small_vocab_pair
    d = write_eagle(target_dir, tmp_path / "head", draft_vocab=draft_vocab, aux=(1,), std=0.5)
    # 4 tokens, the first 3 counted: the second step drafts 2 levels.
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True, num_draft_tokens=2)
    prompt = [0, 3, 4, 5]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = dict(draft_model=str(d), spec_tree_topk=topk)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "eagle", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    # A wrong rule: after a rejection, sample from p again, not from the residual.
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "eagle", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def check_training_beats_start(target, tmp_path, cfg: TrainConfig, depths: int) -> None:
    """Train ``cfg.method`` heads on a random-weight target with peaked distributions (see test_medusa:
    the tiny demo has none to learn): every depth's held-out KL falls, the directory serves with the
    plain greedy output, and it accepts more than its untrained start (0 steps, same cached data)."""
    config = EngineConfig(model=str(target), device="cpu", compile="off", num_kv_blocks=256, block_size=8)
    prompts = [" ".join(str(i * j % 97) for j in range(3, 12)) for i in range(1, 25)]
    out = tmp_path / cfg.method
    report = train_draft(config, out, prompts, cfg, progress=False)
    before, after = report["heldout_before"], report["heldout_after"]
    assert len(after["kl"]) == depths
    assert all(a < b for a, b in zip(after["kl"], before["kl"])), report
    (tmp_path / "start").mkdir()
    shutil.copy(out / "cache.pt", tmp_path / "start" / "cache.pt")
    train_draft(config, tmp_path / "start", prompts, dataclasses.replace(cfg, steps=0), progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=3)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(prompts, params)]
    accepted = {}
    for name in (cfg.method, "start"):
        eng = make(target, None, draft_model=str(tmp_path / name))
        assert eng.spec_method == cfg.method
        assert [o.outputs[0].delta_token_ids for o in eng.generate(prompts, params)] == plain
        accepted[name] = eng.spec_stats.num_accepted_tokens
    assert accepted[cfg.method] > accepted["start"], accepted


def test_self_distillation_accepts_more_than_the_untrained_start(target, tmp_path):
    # A reduced vocabulary: d2t/t2d trained and served.
    cfg = TrainConfig(
        method="eagle", gen_tokens=40, steps=600, batch_size=512, lr=3e-3, save_every=300, draft_vocab=200
    )
    check_training_beats_start(target, tmp_path, cfg, depths=cfg.unroll)


def test_compiled_head_is_exact_and_compiles_nothing_mid_serving(target, tmp_path):
    d = write_eagle(target, tmp_path / "head")
    ps = repetitive_prompts(4, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    plain = [o.outputs[0].delta_token_ids for o in make(target, compile="off").generate(ps, params)]
    eng = make(target, None, draft_model=str(d), compile="on", spec_tree_topk=2)
    assert eng.proposer.runner.compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
    assert eng.spec_stats.num_drafts > 0
    # The catch-up and level forwards ran on the graphs warmup() compiled.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
