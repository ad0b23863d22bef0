"""DFlash block drafting: a tiny random checkpoint written in the published layout (its config's field
names, its tensor names) loads and is picked from ``--draft-model`` alone; the drafter's block logits
equal an independent dense implementation of the published forward, at the first draft and after
catch-ups; greedy output is the plain decoder's with chains and trees, under prefix reuse,
preemption and n > 1; sampled output keeps the target's distribution, and a wrong rule fails the
same test; a broken checkpoint is a start-up error that names what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_ngram import samples
from test_spec import exact_joint, g_statistic, g_test_threshold, small_vocab_pair  # noqa: F401
from test_step import check_n_choices, make
from test_step import prompts as repetitive_prompts
from transformers import AutoConfig, AutoModelForCausalLM

import engine.sampling.verify as verify_mod
from conftest import build_model_dir
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods import resolve_method

TARGET_LAYERS = 4


def write_dflash(target: Path, path: Path, layers=None, block_size=8, num_layers=2, std=0.3, seed=1,
                 mask_token_id: int | None = None, **extra) -> Path:  # fmt: skip
    """A random DFlash drafter for ``target`` written straight in the published layout (the field and
    tensor names of z-lab's checkpoints, not Augur's own writer). ``layers``: the target layers it reads
    (default: layer 1 and the last)."""
    tc = AutoConfig.from_pretrained(target)
    layers = layers or (min(1, tc.num_hidden_layers - 1), tc.num_hidden_layers - 1)
    H, heads, kv, hd, inter = tc.hidden_size, 4, 2, 16, 96
    mask = tc.vocab_size - 1 if mask_token_id is None else mask_token_id
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layers)},
        "num_target_layers": tc.num_hidden_layers,
        "num_hidden_layers": num_layers,
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,  # (not the default: the drafter's own RoPE is read)
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": tc.vocab_size,
        "dtype": "float32",
        **extra,
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape, one=False):
        if one:
            return 1.0 + 0.05 * torch.randn(*shape, generator=g)
        return std * torch.randn(*shape, generator=g) / shape[-1] ** 0.5 * 8

    t = {"fc.weight": w(H, len(layers) * H), "hidden_norm.weight": w(H, one=True), "norm.weight": w(H, one=True)}
    for i in range(num_layers):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": w(H, one=True),
            p + "post_attention_layernorm.weight": w(H, one=True),
            p + "self_attn.q_proj.weight": w(heads * hd, H),
            p + "self_attn.k_proj.weight": w(kv * hd, H),
            p + "self_attn.v_proj.weight": w(kv * hd, H),
            p + "self_attn.o_proj.weight": w(H, heads * hd),
            p + "self_attn.q_norm.weight": w(hd, one=True),
            p + "self_attn.k_norm.weight": w(hd, one=True),
            p + "mlp.gate_proj.weight": w(inter, H),
            p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
        })  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("dflash")
    return build_model_dir(root / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3, num_hidden_layers=TARGET_LAYERS)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos[:, None].double() * inv[None]).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


@torch.no_grad()
def reference_block_logits(target: Path, d: Path, context: list[int], root: int, depth: int) -> torch.Tensor:
    """The published forward, written out densely: the target's ``hidden_states[id + 1]`` over the
    context, fused; the block ``[root, MASK x depth]`` after it, attending to every context position
    and all of itself; the target's output layer on the mask rows. ``[depth, V]``."""
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(d / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hs = model(torch.tensor([context]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[j + 1][0] for j in cfg["dflash_config"]["target_layer_ids"]], -1)
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    n, heads, kv, hd = len(context), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    block = [root] + [cfg["dflash_config"]["mask_token_id"]] * depth
    x = model.get_input_embeddings()(torch.tensor(block))
    pos_c, pos_b = torch.arange(n), torch.arange(n, n + len(block))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])

        def keys(src, pos, p=p):
            k = rms((src @ w[p + "self_attn.k_proj.weight"].T).view(len(src), kv, hd), w[p + "self_attn.k_norm.weight"])
            return rope(k, pos, cfg["rope_theta"]), (src @ w[p + "self_attn.v_proj.weight"].T).view(len(src), kv, hd)

        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(len(block), heads, hd), w[p + "self_attn.q_norm.weight"])
        q = rope(q, pos_b, cfg["rope_theta"])
        kc, vc = keys(ctx, pos_c)
        kb, vb = keys(h, pos_b)
        k = torch.cat([kc, kb]).repeat_interleave(heads // kv, 1)
        v = torch.cat([vc, vb]).repeat_interleave(heads // kv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k).mul(hd**-0.5).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(len(block), heads * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return model.lm_head(rms(x, w["norm.weight"]))[1:]


def drafter_logits(eng, seq, depth: int) -> torch.Tensor:
    """The engine's drafter over ``seq`` as it stands (its catch-up and a block of ``depth``)."""
    proposer = eng.proposer
    root = seq.num_tokens - 1
    assert eng.block_manager.reserve(seq.block_table, root, root + 1 + depth) == []  # (as a step reserves them)
    chunks, features, blocks, rows, _ = proposer._chunks([seq], [depth])
    assert blocks == [(0, depth)]
    return proposer._forward(chunks, features, rows)


def test_the_published_layout_loads_and_drafts_as_the_published_forward(target, tmp_path):
    d = write_dflash(target, tmp_path / "dflash")
    assert resolve_method(None, str(d)) == "dflash"
    eng = make(target, None, draft_model=str(d), compile="off", block_size=4)
    assert eng.spec_method == "dflash" and eng.proposer.hidden_layers == (1, 3)
    # Every tensor landed where its name says (q/k/v and gate/up fused in order).
    saved = load_file(d / "model.safetensors")
    for name, t in eng.proposer.drafter.checkpoint_state().items():
        torch.testing.assert_close(t, saved[name], msg=name)
    assert set(eng.proposer.drafter.checkpoint_state()) == set(saved)
    prompt = repetitive_prompts(1, seed=3)[0]
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, num_draft_tokens=5))
    eng.step()  # the prefill: the first token is the root, every prompt position is context
    seq = eng.groups["r"].seqs[0]
    for round_ in range(3):
        tokens = list(seq.token_ids)
        got = drafter_logits(eng, seq, 5)
        want = reference_block_logits(target, d, tokens[:-1], tokens[-1], 5)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=f"round {round_}")
        for _ in range(3):  # drafts verified, accepted tokens' features caught up next round
            eng.step()


def test_the_trainers_blocks_are_the_published_forward(target, tmp_path):
    """``augur train-draft``'s loss reads the drafter as serving does: two sequences packed side by side
    with two blocks each (scored against the context and within each block apart), every block row's
    logits the published forward's over its own sequence's context before its anchor."""
    from transformers import AutoModelForCausalLM

    from engine.offline.train_dflash import block_logits

    d = write_dflash(target, tmp_path / "dflash")
    drafter = make(target, None, draft_model=str(d), compile="off").proposer.drafter
    dflash = json.loads((d / "config.json").read_text())["dflash_config"]
    ids, mask = dflash["target_layer_ids"], dflash["mask_token_id"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = repetitive_prompts(2, seed=8)
    B, anchors = 4, [(0, 5), (0, 11), (1, 3), (1, 9)]  # (sequence, anchor row)
    with torch.no_grad():
        states = [model(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    feats = [torch.cat([hs[j + 1][0] for j in ids], -1) for hs in states]
    pack = {
        "feats": torch.cat(feats),
        "doc": torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)]),
        "pos": torch.cat([torch.arange(len(s)) for s in seqs]),
        "block_ids": torch.tensor([[seqs[i][t]] + [mask] * (B - 1) for i, t in anchors]),
        "block_pos": torch.tensor([list(range(t, t + B)) for _, t in anchors]),
        "block_doc": torch.tensor([i for i, _ in anchors]),
    }
    with torch.no_grad():
        got = block_logits(drafter, pack)
    for k, (i, t) in enumerate(anchors):
        want = reference_block_logits(target, d, seqs[i][:t], seqs[i][t], B - 1)
        torch.testing.assert_close(got[k, 1:], want, atol=2e-4, rtol=2e-4, msg=f"block {k}")


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_output_is_the_plain_decoders(target, tmp_path, topk):
    d = write_dflash(target, tmp_path / "dflash")
    ps = repetitive_prompts(8, seed=4)
    ps += [ps[0] + [5, 6, 7, 8, 9, 10], ps[0] + [11, 12]]  # a shared prefix: the second reuses cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    # A small pool and step budget: preemptions, chunked prefills and catch-ups over several steps.
    eng = make(target, None, draft_model=str(d), spec_tree_topk=topk, num_kv_blocks=48, max_num_batched_tokens=40)
    assert eng.spec_method == "dflash"
    pinned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=6)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.proposer.num_forwards <= eng.num_steps  # one drafter forward a step, whatever the depth
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    check_n_choices(make(target), make(target, None, draft_model=str(d), spec_tree_topk=topk))


def test_the_block_is_never_longer_than_the_checkpoints(target, tmp_path):
    d = write_dflash(target, tmp_path / "dflash", block_size=4)
    eng = make(target, None, draft_model=str(d))
    assert eng.proposer.deepest(8) == 3 and eng.proposer.slots_needed(8) == 3
    ps = repetitive_prompts(3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=8)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
    assert 0 < eng.spec_stats.num_draft_tokens <= 3 * eng.spec_stats.num_drafts


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "sampled-trees"])
def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch, topk):  # noqa: F811
    target_dir, _ = small_vocab_pair
    d = write_dflash(target_dir, tmp_path / "dflash", layers=(0, 1), std=0.5, mask_token_id=2)
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True, num_draft_tokens=3)
    prompt = [0, 3, 4, 5]
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    kw = dict(draft_model=str(d), spec_tree_topk=topk)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "dflash", **kw), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    # A wrong rule: after a rejection, sample from p again, not from the residual.
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "dflash", **kw), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def test_a_broken_checkpoint_is_a_startup_error_that_says_why(target, tmp_path):
    d = write_dflash(target, tmp_path / "dflash")
    w = load_file(d / "model.safetensors")
    save_file({k: v for k, v in w.items() if k != "layers.1.self_attn.k_norm.weight"}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor layers\.1\.self_attn\.k_norm\.weight"):
        make(target, None, draft_model=str(d))
    save_file({**w, "fc.weight": torch.zeros(64, 3 * 64)}, d / "model.safetensors")  # 3 features, config says 2
    with pytest.raises(ValueError, match=r"fc\.weight has shape"):
        make(target, None, draft_model=str(d))
    save_file(w, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cases = [
        ({"num_target_layers": 36}, "a target of 36 layers"),
        ({"dflash_config": {"mask_token_id": 10**6, "target_layer_ids": [1, 3]}}, "mask_token_id 1000000"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 9]}}, r"target_layer_ids \[9\]"),
        ({"dflash_config": {"target_layer_ids": [1, 3]}}, "names no mask_token_id"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "only full_attention"),
        ({"hidden_size": 128}, "hidden_size 128 differs"),
    ]
    for change, message in cases:
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            make(target, None, draft_model=str(d))


def test_self_distillation_accepts_more_than_the_untrained_start(target, tmp_path):
    """``augur train-draft --method dflash`` on a random-weight target with peaked distributions: every
    depth's held-out KL falls, the directory it writes (the published layout) serves with the plain
    greedy output, and it accepts more than its untrained start."""
    from test_eagle import check_training_beats_start

    from engine.offline.train_draft import TrainConfig

    cfg = TrainConfig(method="dflash", num_layers=1, block_size=4, gen_tokens=40, steps=300, batch_size=512,
                      lr=3e-3, save_every=300, anchors=16)  # fmt: skip
    check_training_beats_start(target, tmp_path, cfg, depths=cfg.block_size - 1)


def test_the_command_weights_a_blocks_depths_as_asked(target, tmp_path):
    """``augur train-draft``: a DFlash block's depths are weighted 0.3 ** (k - 1) unless
    ``--head-decay`` says otherwise (what the report records is what the loss used)."""
    from server.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "class A:", "import os"]))
    base = ["train-draft", "--method", "dflash", "--model", str(target), "--data", str(data), "--device", "cpu",
            "--num-prompts", "3", "--gen-tokens", "6", "--steps", "1", "--num-layers", "1", "--dflash-block", "4",
            "--dflash-anchors", "2", "--batch-size", "64", "--output", str(tmp_path / "d")]  # fmt: skip
    decays = []
    for extra in ([], ["--head-decay", "0.9"]):  # (the second run reuses the first one's cache)
        assert main(base + extra) == 0
        decays.append(json.loads((tmp_path / "d" / "report.json").read_text())["config"]["head_decay"])
    assert decays == [0.3, 0.9]


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_exact_through_graphs_on_gpu(target, tmp_path, topk):
    """As served on a GPU: the drafter's one forward replays a captured graph (context rows, the block
    and their features in static buffers) on the triton backend, and greedy output stays the plain
    decoder's."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    d = write_dflash(target, tmp_path / "dflash")

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(target), device="cuda", dtype="float32", block_size=4, **kw))

    ps = repetitive_prompts(8, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=6)
    plain = [o.outputs[0].delta_token_ids for o in engine(num_kv_blocks=256).generate(ps, params)]
    eng = engine(draft_model=str(d), spec_tree_topk=topk, num_kv_blocks=64, max_num_batched_tokens=64)
    assert eng.proposer.runner.graphs is not None and eng.proposer.runner.attention_backend == "triton"
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
    assert eng.spec_stats.num_drafts > 0


def test_compiled_drafter_is_exact_and_compiles_nothing_mid_serving(target, tmp_path):
    d = write_dflash(target, tmp_path / "dflash")
    ps = repetitive_prompts(4, seed=6) + [list(range(3, 60))]  # a long prompt: a catch-up over two steps
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=4)
    plain = [o.outputs[0].delta_token_ids for o in make(target, compile="off").generate(ps, params)]
    eng = make(target, None, draft_model=str(d), compile="on", max_num_batched_tokens=32)
    assert eng.proposer.runner.compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
    assert eng.spec_stats.num_drafts > 0
    # The drafter's forwards ran on the graphs warm_compiled() compiled.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
