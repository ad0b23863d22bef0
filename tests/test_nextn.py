"""GLM-4.5's own multi-token-prediction layer as the drafter (``--speculative-method nextn``): the layer
is read from the target's checkpoint and computes what the published module computes (transformers'
own GLM decoder layer, fed as SGLang and vLLM feed it); every drafted token is the plain decoder's
under greedy decoding (chains, trees, preemption, a reused prefix; one rank and two); sampling keeps the
target's distribution, and a wrong rule fails; a target without the layer is a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_moe import build_moe_dir, make
from test_spec import check_speculative_sampling, small_vocab_pair  # noqa: F401
from test_step import prompts as repetitive_prompts

from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk
from engine.speculative.methods.nextn import EXTRAS, SHARED

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GLM = "Glm4MoeForCausalLM"


def add_nextn_layer(src: Path, dst: Path, std: float = 0.1, seed: int = 3) -> Path:
    """``src`` with the prediction layer the released checkpoints carry (transformers saves none):
    ``model.layers.{num_hidden_layers}`` as a noisy copy of the last decoder layer, its projection
    mostly passing the target's state through, and its own copies of the embedding and output layer."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return std * torch.randn(*shape, generator=g)

    last = f"model.layers.{n - 1}."
    layer = {
        k.replace(last, f"model.layers.{n}."): v + noise(*v.shape) for k, v in tensors.items() if k.startswith(last)
    }
    p = f"model.layers.{n}."
    layer |= {
        p + "enorm.weight": 1 + noise(h),
        p + "hnorm.weight": 1 + noise(h),
        p + "eh_proj.weight": torch.cat([noise(h, h), torch.eye(h) + noise(h, h)], 1),
        p + "shared_head.norm.weight": 1 + noise(h),
        p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    save_file({**tensors, **layer}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("nextn")
    return add_nextn_layer(build_moe_dir(root / "plain", tokenizer_dir, GLM), root / "glm")


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_logits(d: Path, ids: list[int], tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's logits for rows ``0 .. len(ids) - 2`` as the published module computes them, with
    transformers' own GLM decoder layer (a mixture, as the layer is) between its fusion and its head;
    and the target's final-normed states."""
    cfg = transformers.AutoConfig.from_pretrained(d)
    w = load_file(d / "model.safetensors")
    target = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        state = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # final-normed
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n}."
    # transformers' GLM with one decoder layer, a mixture, holding the layer's weights (read by
    # from_pretrained, which fuses the experts as transformers runs them) and the layer's norm and head
    one = transformers.Glm4MoeConfig(**{**cfg.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
    mine = {
        k.replace(p, "model.layers.0."): v
        for k, v in w.items()
        if k.startswith(p) and k[len(p) :] not in (*EXTRAS, *SHARED)
    }
    mine |= {"model.norm.weight": w[p + "shared_head.norm.weight"], "lm_head.weight": w[p + "shared_head.head.weight"]}
    mine["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
    one.save_pretrained(tmp)
    save_file(mine, tmp / "model.safetensors", metadata={"format": "pt"})
    block = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    e = w[p + "embed_tokens.weight"][torch.tensor(ids[1:])]
    x = torch.cat([rms(e, w[p + "enorm.weight"], eps), rms(state[:-1], w[p + "hnorm.weight"], eps)], -1)
    with torch.no_grad():
        return block(inputs_embeds=(x @ w[p + "eh_proj.weight"].T)[None]).logits[0], state


def test_the_layer_computes_the_published_module(glm, tmp_path):
    ids = [5, 9, 14, 3, 22, 7, 40, 11]
    want, state = reference_logits(glm, ids, tmp_path)
    eng = make(glm, "nextn")
    # The target's own forward gives the state before its final norm, as a verify forward does; the
    # proposer's catch-up norms it and feeds the rows to the layer.
    n, last = len(ids) - 1, eng.proposer.hidden_layers
    table = list(range(-(-len(ids) // 4)))
    target = eng.runner.execute(eng.runner.prepare([ForwardChunk(ids, 0, table, 1)]), hidden_layers=last)
    torch.testing.assert_close(target.final_hidden, state, rtol=1e-4, atol=1e-4)
    chunks = [ForwardChunk(ids[1:], 0, table, n)]
    logits, _ = eng.proposer._forward(
        eng.proposer.runner.prepare(chunks), chunks, hidden_in=target.hidden_states[last[0]][:-1]
    )
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # It is the checkpoint's layer, routed by its own experts, and not the target's last one.
    head = eng.proposer.head
    assert head.first == 4 and head.layers[0].mlp.num_experts == 12
    assert not torch.equal(head.layers[0].input_layernorm.weight, eng.runner.model.layers[3].input_layernorm.weight)
    assert head.embed_tokens is eng.runner.model.embed_tokens  # the target's own table, not a copy


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_greedy_tokens_are_the_plain_decoders(glm, topk):
    ps = repetitive_prompts(6, seed=9)
    ps += [ps[0] + [5, 6, 7, 8]]  # a shared prefix: cached blocks reused
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(glm).generate(ps, params)]
    # 40 blocks of 4 tokens for 7 sequences of up to 50: some are preempted and come back
    eng = make(glm, "nextn", num_kv_blocks=40, max_num_batched_tokens=40, spec_tree_topk=topk)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0 and eng.spec_stats.num_accepted_tokens > 0
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_in_bfloat16_a_requests_tokens_are_its_plain_tokens_in_any_batch(glm):
    """The batch-invariant bfloat16 engine: the layer runs on the same operators as the target's, and
    a request's greedy tokens drafted by it, in a batch, are its plain tokens alone."""
    from test_engine import prompts

    ps = prompts(8, seed=4, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = make(glm, "none", dtype="bfloat16", batch_invariant="on", compile="off")
    alone = [plain.generate([p], params)[0].outputs[0].delta_token_ids for p in ps]
    eng = make(glm, "nextn", dtype="bfloat16", batch_invariant="on", compile="off")
    assert eng.batch_invariant and eng.proposer.head.batch_invariant
    pinned = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == alone
    assert eng.spec_stats.num_drafts > 0


def test_in_bfloat16_the_layers_linears_are_packed_as_the_targets(glm):
    """Without the invariant operators a CPU with AVX512-BF16 packs the linears of a bfloat16 model (its
    small-rows layers): the layer's own, as the target's, not the target's output layer, which it shares."""
    from engine.models.small_linear import load_small_linear

    eng = make(glm, "nextn", dtype="bfloat16", batch_invariant="off", compile="off")
    head, target = eng.proposer.head, eng.runner.model
    packed = type(target.layers[3].self_attn.qkv_proj)
    assert type(head.eh_proj) is packed and (packed is not torch.nn.Linear) == load_small_linear()
    assert head.lm_head is target.lm_head
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    out = eng.generate(repetitive_prompts(3, seed=1), params)
    assert all(len(o.outputs[0].delta_token_ids) == 12 for o in out) and eng.spec_stats.num_drafts > 0


def test_served_through_the_sdk(glm):
    from families import check_served

    check_served(glm, make(glm), speculative_method="nextn")


def test_under_quantization_the_layer_is_quantized_as_the_targets_layers(glm):
    ps = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    plain = make(glm, quantization="int4", dtype="bfloat16")
    eng = make(glm, "nextn", quantization="int4", dtype="bfloat16")
    want = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == want
    ours, targets = eng.proposer.head.layers[0].self_attn.qkv_proj, eng.runner.model.layers[3].self_attn.qkv_proj
    assert type(ours) is type(targets) and not isinstance(ours, torch.nn.Linear)


def test_at_two_ranks_the_layer_is_sharded_and_exact(glm):
    ps = repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    one = make(glm, "nextn", compile="off")
    want = [o.outputs[0].delta_token_ids for o in one.generate(ps, params)]
    eng = make(glm, "nextn", compile="off", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == want
        assert (
            eng.proposer.head.tp.size == 2 and eng.spec_stats.num_accepted_tokens == one.spec_stats.num_accepted_tokens
        )
    finally:
        eng.close()


def test_sampling_keeps_the_targets_distribution(small_vocab_pair, tmp_path, monkeypatch):  # noqa: F811
    """An 8-token GLM target drafting with its own layer: the joint of three sampled tokens is the
    target's (G-test), and the wrong residual rule fails it."""
    tok_dir = Path(small_vocab_pair[0]).parent / "tok"
    target = add_nextn_layer(build_moe_dir(tmp_path / "plain", tok_dir, GLM, vocab=8, std=0.5), tmp_path / "glm")
    check_speculative_sampling(target, None, 1, monkeypatch, speculative_method="nextn", dtype="float32")


def test_a_target_without_the_layer_is_a_clear_error(glm, tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="has none"):
        make(build_moe_dir(tmp_path / "qwen", tokenizer_dir, "Qwen3MoeForCausalLM"), "nextn")
    with pytest.raises(
        ValueError, match=r"no multi-token-prediction layer model\.layers\.4 \(missing model\.layers\.4\.enorm"
    ):
        make(build_moe_dir(tmp_path / "saved", tokenizer_dir, GLM), "nextn")  # (transformers saved it: no layer)
