"""Mixture-of-experts targets (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against
transformers on tiny random checkpoints, and every proposer exact on one.

- The grouped experts (slots sorted by expert, one product per expert) compute what a token-by-token
  loop over its chosen experts computes, and a batch routes each token as the token alone.
- Logits within float32 tolerance of transformers' through chunked prefill and paged decodes, at 1 and
  2 ranks; greedy tokens equal to ``generate`` with requests joining a running batch.
- Greedy speculation gives the plain decoder's tokens with each proposer (draft model, n-gram, suffix,
  lookahead, layer skipping over mixture blocks, an EAGLE-3 head); sampled speculation keeps the MoE
  target's distribution (G-test), and a wrong rule fails the same test.
- Under the batch-invariant mode, in bfloat16, a request's tokens alone equal its tokens in a batch.
- Served through the OpenAI SDK.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from families import check_served
from test_engine import check_logits_parity, hf_greedy, run_staggered
from test_spec import (  # noqa: F401
    check_speculative_sampling,
    noisy_copy,
    small_vocab_pair,
)
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, build_model_dir, hf_causal_lm
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.moe import SparseMoE
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def moe_config(arch: str, vocab: int = VOCAB) -> transformers.PretrainedConfig:
    """Tiny configs with a dense layer among the mixtures where the family allows one."""
    common = dict(COMMON, vocab_size=vocab, architectures=[arch])
    if arch == "Qwen3MoeForCausalLM":  # layer 1 dense (mlp_only_layers), top-2 of 8, renormalized
        return transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
    if arch == "Qwen2MoeForCausalLM":  # every second layer a mixture; a shared expert; top-3, not renormalized
        return transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
        )  # fmt: skip
    if arch == "MixtralForCausalLM":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if arch == "Glm4MoeForCausalLM":  # layer 0 dense; 12 experts in 3 groups, each token's 3 from its best 2 groups
        return transformers.Glm4MoeConfig(
            **common, head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=12,
            num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            num_nextn_predict_layers=1,
        )  # fmt: skip
    if arch == "MiniMaxM2ForCausalLM":  # RoPE on 8 of 16 dims; q/k norms over whole projections; 3 of 8 by sigmoid
        return transformers.MiniMaxM2Config(
            **common, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=3, rotary_dim=8,
        )  # fmt: skip
    mla = dict(  # multi-head latent attention: a low-rank latent of 48, 16 + 8 dims a query head, values of 12
        kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=12, num_experts_per_tok=3,
        n_shared_experts=1, norm_topk_prob=True,
    )  # fmt: skip
    if arch == "DeepseekV3ForCausalLM":  # low-rank queries, YaRN with its softmax scale, 3 of 4 groups' experts
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                    mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)  # fmt: skip
        return transformers.DeepseekV3Config(
            **{**common, **mla}, q_lora_rank=40, n_group=4, topk_group=3, first_k_dense_replace=1,
            routed_scaling_factor=2.5, rope_parameters=yarn, num_nextn_predict_layers=1,
        )  # fmt: skip
    if arch == "Glm4MoeLiteForCausalLM":  # full-rank queries, plain RoPE, one group; layers 0 and 2 dense
        return transformers.Glm4MoeLiteConfig(
            **{**common, **mla}, q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_nextn_predict_layers=1,
        )  # fmt: skip
    if arch == "DeepseekV2ForCausalLM":  # V2's: a softmax router, top 3 in the best 2 of 4 groups, not renormalized
        return transformers.DeepseekV2Config(
            **{**common, **mla, "norm_topk_prob": False, "n_shared_experts": 2}, q_lora_rank=40, n_group=4,
            topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=16.0,
        )  # fmt: skip
    if arch == "Ernie4_5ForCausalLM":  # interleaved RoPE pairs; biases everywhere (use_bias); an untied head
        return transformers.Ernie4_5Config(**common, head_dim=16, intermediate_size=96, use_bias=True,
                                           tie_word_embeddings=False)  # fmt: skip
    if arch == "Ernie4_5_MoeForCausalLM":  # layer 0 dense; 3 of 8 experts picked with an expert bias; a shared one
        return transformers.Ernie4_5_MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8, moe_k=3,
            moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=1,
        )  # fmt: skip
    if arch == "Mistral4ForCausalLM":  # a softmax router, 3 in the best 2 of 4 groups; queries scaled from position 8
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                    mscale_all_dim=1.0, beta_fast=32, beta_slow=1, llama_4_scaling_beta=0.5)  # fmt: skip
        return transformers.Mistral4Config(
            **{**common, **mla}, q_lora_rank=40, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.0, rope_parameters=yarn,
        )  # fmt: skip
    raise ValueError(arch)


ARCHS = [
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
]


def build_moe_dir(path: Path, tokenizer_dir: Path, arch: str, vocab: int = VOCAB, std: float = 0.08) -> Path:
    """A random-weight checkpoint saved as transformers saves it (one matrix per expert). Routers get
    larger weights than the rest, so that tokens spread over the experts."""
    torch.manual_seed(0)
    config = moe_config(arch, vocab)
    model = getattr(transformers, arch)(config).float()  # (Mistral 4's is not among AutoModelForCausalLM's)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.5)
            elif p.dim() > 1:
                p.normal_(0.0, std)
            else:
                norm = "norm" in name or p.shape[0] in (config.hidden_size, getattr(config, "head_dim", -1))
                p.normal_(1.0 if norm else 0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's: large enough to change which experts win
                b.normal_(0.0, 0.3)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_moe_dir(root / arch, tokenizer_dir, arch) for arch in ARCHS}


def make(model_dir, method: str | None = None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(model=str(model_dir), speculative_method=method, **kw))


# -- the block -----------------------------------------------------------------------------------------
def token_by_token(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The mixture by its definition: each token through each of its chosen experts, weighted."""
    ids, weights = block.route(x)
    inter = block.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(block.top_k):
            e = int(ids[t, j])
            gate_up = block.experts_gate_up[e] @ x[t]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, j] * (block.experts_down[e] @ h)
    return out


@pytest.fixture(scope="module")
def block() -> SparseMoE:
    torch.manual_seed(1)
    b = SparseMoE(32, 24, num_experts=6, top_k=2, norm_topk_prob=True, act="silu")
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0.0, 0.3)
    return b


def test_grouped_experts_compute_the_token_by_token_mixture(block):
    x = torch.randn(40, 32)
    with torch.no_grad():
        ids, _ = block.route(x)
        assert len(ids.unique()) == 6, "every expert should get tokens here"
        torch.testing.assert_close(block(x), token_by_token(block, x), rtol=1e-5, atol=1e-5)


def test_a_batch_routes_each_token_as_the_token_alone(block):
    x = torch.randn(33, 32)
    with torch.no_grad():
        ids, weights = block.route(x)
        batch = block(x)
        for t in range(x.shape[0]):
            one_ids, one_weights = block.route(x[t : t + 1])
            assert torch.equal(one_ids, ids[t : t + 1])
            torch.testing.assert_close(one_weights, weights[t : t + 1], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(block(x[t : t + 1]), batch[t : t + 1], rtol=1e-5, atol=1e-5)


def test_the_mixture_keeps_a_rows_bits_in_any_batch_under_the_invariant_operators(block):
    """bfloat16 on augur::invariant_linear / invariant_act_mul: a token's output alone equals its row
    in batches of every size (its expert's other rows differ by batch)."""
    from engine.models.invariant import load_invariant_kernels

    if not load_invariant_kernels():
        pytest.skip("no C++ compiler")
    b = SparseMoE(32, 24, num_experts=6, top_k=2, norm_topk_prob=True, act="silu").to(torch.bfloat16)
    b.load_state_dict(block.state_dict())
    b.invariant = True
    x = torch.randn(48, 32).to(torch.bfloat16)
    with torch.no_grad():
        alone = torch.cat([b(x[t : t + 1]) for t in range(x.shape[0])])
        for n in (2, 7, 16, 48):
            assert torch.equal(b(x[:n]), alone[:n]), n


# -- families against transformers --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(moe_dirs, arch):
    check_logits_parity(moe_dirs[arch], "cpu")


def test_the_checkpoints_route_tokens_to_many_experts(moe_dirs):
    """So that parity above is about routing: the tiny Qwen3-MoE's first layer sends a prompt's tokens
    to most of its experts, and its dense layer is a plain MLP."""
    model = make(moe_dirs["Qwen3MoeForCausalLM"]).runner.model
    assert isinstance(model.layers[0].mlp, SparseMoE) and not isinstance(model.layers[1].mlp, SparseMoE)
    x = model.embed(torch.tensor(list(range(3, 60))))
    with torch.no_grad():
        ids, _ = model.layers[0].mlp.route(model.layers[0].post_attention_layernorm(x))
    assert len(ids.unique()) >= 6


def check_greedy_matches_generate(model_dir: Path) -> None:
    """Greedy tokens equal to transformers' ``generate``, requests joining a running batch."""
    from test_engine import prompts

    engine = make(model_dir, max_num_batched_tokens=40)
    ps = prompts(5, seed=3, lo=8, hi=40)
    got = run_staggered(engine, ps, SamplingParams(temperature=0.0, max_tokens=10))
    ref = hf_causal_lm(model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, 10), i


def check_bf16_alone_equals_batch(model_dir: Path, n: int = 8) -> None:
    """In bfloat16 under the batch-invariant mode, each request's greedy tokens alone equal its tokens in
    a batch that requests join every step."""
    from test_engine import prompts

    eng = make(model_dir, "none", dtype="bfloat16", batch_invariant="on", compile="off")
    ps = prompts(n, seed=4, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [eng.generate([p], params)[0].outputs[0].delta_token_ids for p in ps]
    got = run_staggered(eng, ps, params, every=1)
    assert [got[f"r{i}"] for i in range(len(ps))] == alone


def check_speculation_is_plain(target: Path, method: str, plain_dir: Path | None = None, **kw) -> None:
    """Greedy tokens of ``method`` drafting for ``target`` (3 drafts pinned) equal plain decoding's (of
    ``plain_dir``, where it differs: the same model in another checkpoint), and drafts were made."""
    from test_step import prompts as repetitive_prompts

    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(plain_dir or target).generate(ps, params)]
    eng = make(target, method, **kw)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(moe_dirs, arch):
    check_greedy_matches_generate(moe_dirs[arch])


def test_sharded_logits_match_the_unsharded_model(moe_dirs):
    """-tp 2: each rank holds half of every expert's inner dimension (and of the dense layer's and the
    shared expert's), the routers whole."""
    dirs = [moe_dirs[a] for a in ARCHS]
    for arch, d, sharded in zip(ARCHS, dirs, sharded_logits(dirs, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=arch)


def test_an_engine_at_two_ranks_decodes_as_one_rank_does(moe_dirs):
    d = moe_dirs["Qwen2MoeForCausalLM"]
    ps = repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    one = [o.outputs[0].delta_token_ids for o in make(d, "ngram", compile="off").generate(ps, params)]
    eng = make(d, "ngram", compile="off", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == one
    finally:
        eng.close()


def test_a_rank_holds_half_of_each_expert():
    from engine.parallel import TensorParallel

    whole = SparseMoE(32, 24, 4, 2, True, "silu", shared_intermediate=16)
    half = SparseMoE(32, 24, 4, 2, True, "silu", tp=TensorParallel(1, 2, ""), shared_intermediate=16)
    assert half.experts_gate_up.shape == (4, 24, 32) and whole.experts_gate_up.shape == (4, 48, 32)
    assert half.experts_down.shape == (4, 32, 12) and half.gate.weight.shape == whole.gate.weight.shape
    assert half.shared_expert.gate_up_proj.weight.shape == (16, 32)


# -- GLM-4.5's routing and checkpoints ---------------------------------------------------------------------------
def test_glm_routing_keeps_to_the_best_groups_and_weighs_by_the_unbiased_scores():
    """Against the rule written out for one token: the bias picks, the scores weigh; a group's worth is
    its two best biased scores; ties go to the lower expert."""
    from engine.models.glm4_moe import sigmoid_route

    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5, 2.5, -3.0, -2.0, -3.0]])
    bias = torch.tensor([0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    scores = torch.sigmoid(logits[0])  # .88 .50 .27 .62 | .92 .05 .12 .05
    choice = scores + bias  # groups {0..3}, {4..7}: worth 1.40 + .88 and .92 + .12: the first is kept
    ids, weights = sigmoid_route(logits, bias, 2, 2, 1, True, 2.5)
    assert ids.tolist() == [[1, 0]]  # by the biased scores: expert 1 (1.40), not 3 (.62 > .50 unbiased)
    want = scores[[1, 0]] / scores[[1, 0]].sum() * 2.5
    torch.testing.assert_close(weights[0], want)
    assert choice[4] > choice[0]  # expert 4 would come second were the groups not kept to one
    ids, _ = sigmoid_route(logits, bias, 2, 1, 1, True, 2.5)
    assert ids.tolist() == [[1, 4]]
    tied = sigmoid_route(torch.zeros(1, 8), torch.zeros(8), 3, 2, 2, False, 1.0)[0]
    assert tied.tolist() == [[0, 1, 2]]


def test_glm_loads_without_its_prediction_layer_and_keeps_the_router_in_float32(moe_dirs, tmp_path):
    """The released checkpoints carry a multi-token-prediction layer past the decoder's layers
    (``model.layers.{num_hidden_layers}``), which transformers does not build: it is not read. In a
    bfloat16 engine the router's weight and expert bias stay float32 (transformers keeps them so)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "glm"
    shutil.copytree(moe_dirs["Glm4MoeForCausalLM"], d)
    tensors = load_file(d / "model.safetensors")
    n = 4  # the config's num_hidden_layers
    extra = {k.replace(".layers.3.", f".layers.{n}."): v.clone() for k, v in tensors.items() if ".layers.3." in k}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    want = make(moe_dirs["Glm4MoeForCausalLM"]).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    got = make(d).generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert got[0].outputs[0].delta_token_ids == want[0].outputs[0].delta_token_ids
    bf16 = make(d, dtype="bfloat16").runner.model
    router = bf16.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert bf16.layers[1].mlp.experts_gate_up.dtype == torch.bfloat16
    torch.testing.assert_close(
        router.e_score_correction_bias, tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    )


# -- MiniMax-M2's checkpoints ----------------------------------------------------------------------------
def test_minimax_m2_reads_its_expert_bias_skips_prediction_modules_and_refuses_lightning_attention(moe_dirs, tmp_path):
    """The expert bias is read from beside the router (Mixtral's names) onto it, float32 in a bfloat16
    engine; the bias decides which experts win (set to zero, the tokens change); multi-token-prediction
    tensors are passed over; a config with a linear-attention layer (MiniMax-Text-01's) is refused."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = moe_dirs["MiniMaxM2ForCausalLM"]
    tensors = load_file(src / "model.safetensors")
    bias = tensors["model.layers.1.block_sparse_moe.e_score_correction_bias"]
    bf16 = make(src, dtype="bfloat16").runner.model
    router = bf16.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(router.e_score_correction_bias, bias)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = [[5, 6, 7, 8, 9], [11, 3, 40, 7, 22, 9]]
    want = [o.outputs[0].delta_token_ids for o in make(src).generate(ps, params)]
    d = tmp_path / "m2"
    shutil.copytree(src, d)
    extra = {"model.mtp.0.eh_proj.weight": torch.randn(64, 128), "model.layers.4.eh_proj.weight": torch.randn(64, 128)}
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    assert [o.outputs[0].delta_token_ids for o in make(d).generate(ps, params)] == want

    unbiased = {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in tensors.items()}
    save_file(unbiased, d / "model.safetensors", metadata={"format": "pt"})
    assert [o.outputs[0].delta_token_ids for o in make(d).generate(ps, params)] != want

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attn_type_list": [0, 1, 1, 1]}))
    with pytest.raises(ValueError, match="attn_type_list"):
        make(d)


def test_minimax_m2s_qk_norm_rounds_as_transformers_in_bfloat16():
    """MiniMax-M2's q/k norm (OLMo 2's over a whole projection) rounds the normalized input before it
    scales, as transformers' MiniMax-M2 norm does: bit for bit in bfloat16, where OLMo 2's order (scale,
    then round) gives other bits."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    from engine.models.minimax_m2 import MiniMaxM2Norm
    from engine.models.olmo2 import Olmo2RMSNorm

    torch.manual_seed(3)
    x = torch.randn(64, 256).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(256)).to(torch.bfloat16)
    ref = MiniMaxM2RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    ours, olmo = MiniMaxM2Norm(256, 1e-6).to(torch.bfloat16), Olmo2RMSNorm(256, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        for norm in (ref, ours, olmo):
            norm.weight.copy_(weight)
        assert torch.equal(ours(x), ref(x))
        assert not torch.equal(olmo(x), ref(x))


# -- speculating on a mixture -------------------------------------------------------------------------------
def speculators(target: Path, root: Path, tokenizer_dir: Path) -> dict[str, dict]:
    from test_dflash import write_dflash
    from test_eagle import write_eagle
    from test_layer_skip import write_skip
    from test_medusa import write_heads as medusa_heads
    from test_mtp import write_heads as mtp_heads

    from engine.models.layer_skip import LayerSkip

    dense_draft = build_model_dir(root / "draft", tokenizer_dir, "LlamaForCausalLM", std=0.3)
    return {
        "draft": dict(draft_model=str(dense_draft), spec_tree_topk=2),
        "ouroboros": dict(draft_model=str(dense_draft)),
        "medusa": dict(draft_model=str(medusa_heads(target, root / "medusa", like_target=True))),
        "mtp": dict(draft_model=str(mtp_heads(target, root / "mtp"))),
        "ngram": {},
        "suffix": {},
        "lookahead": {},
        "layer-skip": dict(layer_skip_config=write_skip(root, LayerSkip(frozenset({2}), frozenset({2, 3})))),
        "eagle": dict(draft_model=str(write_eagle(target, root / "eagle")), spec_tree_topk=2),
        "dflash": dict(draft_model=str(write_dflash(target, root / "dflash"))),
    }


@pytest.mark.parametrize(
    "arch,method",
    [("Qwen3MoeForCausalLM", m) for m in
     ["draft", "ouroboros", "ngram", "suffix", "lookahead", "layer-skip", "medusa", "mtp", "eagle", "dflash"]]
    + [("Glm4MoeForCausalLM", m) for m in ["draft", "ngram", "layer-skip", "eagle"]]
    + [("MiniMaxM2ForCausalLM", m) for m in ["draft", "suffix", "layer-skip", "eagle"]],
)  # fmt: skip
def test_every_proposer_gives_the_plain_decoders_tokens(moe_dirs, tmp_path, tokenizer_dir, arch, method):
    target = moe_dirs[arch]
    ps = repetitive_prompts(6, seed=9)
    ps += [ps[0] + [5, 6, 7, 8]]  # a shared prefix: cached blocks reused
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    kw = speculators(target, tmp_path, tokenizer_dir)[method]
    eng = make(target, method, num_kv_blocks=64, max_num_batched_tokens=40, **kw)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_sampled_speculation_keeps_the_mixtures_distribution(small_vocab_pair, tmp_path, monkeypatch):  # noqa: F811
    """An 8-token Qwen3-MoE target with a noisy copy of itself drafting: the joint of three sampled
    tokens is the target's (G-test), and the wrong residual rule fails it."""
    tok_dir = Path(small_vocab_pair[0]).parent / "tok"
    target = build_moe_dir(tmp_path / "target", tok_dir, "Qwen3MoeForCausalLM", vocab=8, std=0.5)
    check_speculative_sampling(target, noisy_copy(target, tmp_path / "draft", 0.3), 1, monkeypatch)


# -- the batch-invariant mode, bfloat16 ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"])
def test_a_requests_tokens_alone_equal_its_tokens_in_a_batch_in_bfloat16(moe_dirs, arch):
    from test_engine import prompts

    eng = make(moe_dirs[arch], "none", dtype="bfloat16", batch_invariant="on", compile="off")
    assert eng.batch_invariant
    ps = prompts(10, seed=4, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [eng.generate([p], params)[0].outputs[0].delta_token_ids for p in ps]
    got = run_staggered(eng, ps, params, every=1)
    assert [got[f"r{i}"] for i in range(len(ps))] == alone


# -- served ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_served_through_the_sdk(moe_dirs, arch):
    check_served(moe_dirs[arch], make(moe_dirs[arch]))


def test_an_unknown_mixture_is_a_clear_error(tmp_path, moe_dirs):
    import json
    import shutil

    from engine.models import UnsupportedModelError

    d = tmp_path / "unknown"
    shutil.copytree(moe_dirs["MixtralForCausalLM"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3NextForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"Qwen3NextForCausalLM.*supported: .*Qwen3MoeForCausalLM"):
        load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64)


# -- the GPU kernels (Triton's interpreter on CPU tensors) ------------------------------------------------
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tests that follow it run on either


def test_row_blocks_cover_each_experts_rows_once():
    from engine.models.moe_triton import row_blocks

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 0]])
    order, block_expert, block_start, seg_end = row_blocks(ids, 5, 2)
    flat = ids.flatten()
    assert torch.equal(flat[order], flat.sort(stable=True).values)
    assert seg_end.tolist() == [3, 5, 6, 10, 10]  # expert 4 has no rows
    rows = {}
    for e, s in zip(block_expert.tolist(), block_start.tolist()):
        if e < 5:
            rows.setdefault(e, []).extend(r for r in range(s, s + 2) if r < seg_end[e])
    assert rows == {0: [0, 1, 2], 1: [3, 4], 2: [5], 3: [6, 7, 8, 9]}
    assert block_expert.shape[0] == 5 + 5 and (block_expert == 5).sum() == 10 - 6  # the grid's bound, the rest idle


@pytest.mark.parametrize(
    "E,k,T,block_m",
    [(5, 2, 5, 2), (128, 8, 1, 16), (128, 8, 8, 16), (60, 4, 17, 16), (4, 2, 140, 64), (3, 3, 11, 4), (8, 2, 40, 16)],
)
def test_the_layout_kernel_gives_row_blocks_values(E, k, T, block_m):
    """The one-program layout of a decode's or a verify's slots (Qwen3-30B-A3B's 128 experts at k = 8,
    widths off the powers of two, experts with no rows, with exactly a block's rows, prefill blocks)
    holds the very values torch's sort and scans give."""
    from engine.models.moe_triton import device_row_blocks, row_blocks

    g = torch.Generator().manual_seed(E * 100 + T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if (E, T) == (5, 5):  # expert 0 gets exactly two blocks of 2, expert 4 none
        ids = torch.tensor([[0, 1], [0, 2], [3, 0], [1, 3], [0, 2]])
    ids = ids.to(KERNEL_DEVICE)  # (compiled on a GPU, in the GPU battery; interpreted on a CPU)
    for want, got in zip(row_blocks(ids, E, block_m), device_row_blocks(ids, E, block_m), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("after", [False, True], ids=["softmax-then-top-k", "top-k-then-softmax"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalized"])
@pytest.mark.parametrize("E,k", [(128, 8), (60, 4), (8, 1)])
def test_the_routing_kernel_routes_as_the_eager_router(after, renormalize, E, k):
    """augur::moe_route's kernel: the eager router's experts in its order, its weights within float32
    rounding, a token's routing alone equal to its row in a batch; at a tie (bfloat16 logits tie often
    among 128 experts) the lower index first, in the kernel and the eager router alike."""
    from engine.models.moe import moe_route
    from engine.models.moe_triton import triton_moe_route

    g = torch.Generator().manual_seed(E + k)
    logits = (torch.randn(9, E, generator=g) * 2).to(KERNEL_DEVICE)
    ids, weights = triton_moe_route(logits, k, renormalize, after)
    want_ids, want_weights = moe_route(logits, k, renormalize, after)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)  # (a GPU's exp: a few ulps)
    alone_ids, alone_weights = triton_moe_route(logits[4:5], k, renormalize, after)
    assert torch.equal(alone_ids, ids[4:5]) and torch.equal(alone_weights, weights[4:5])
    tied = torch.full((1, E), -1.0).to(torch.bfloat16).to(KERNEL_DEVICE)
    tied[0, [E - 1, E // 2, 0]] = 3.0  # three equal best logits
    tied_ids, tied_weights = triton_moe_route(tied, k, renormalize, after)
    assert tied_ids[0].tolist() == ([0, E // 2, E - 1] + [1, 2, 3, 4, 5])[:k]
    assert torch.equal(moe_route(tied, k, renormalize, after)[0], tied_ids)  # the eager router's rule too
    if k > 1:
        assert tied_weights[0, 0] == tied_weights[0, 1]


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "clamped_swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gpu_kernels_compute_the_mixture(act, dtype):
    """The Triton kernels (on CPU tensors, interpreted) against the host version: every activation, the
    biases gpt-oss has, decode-sized and prefill-sized row blocks."""
    from engine.models.moe import moe_experts
    from engine.models.moe_triton import triton_moe_experts

    g = torch.Generator().manual_seed(5)
    E, H, I, k = 4, 48, 40, 2  # noqa: E741  (widths off the tiles' multiples)
    for T in (3, 140):  # 140 * 2 rows over 4 experts: 64-row blocks
        x = torch.randn(T, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=g), -1)
        gate_up = (0.2 * torch.randn(E, 2 * I, H, generator=g)).to(dtype)
        down = (0.2 * torch.randn(E, H, I, generator=g)).to(dtype)
        biases = (torch.randn(E, 2 * I, generator=g).to(dtype), torch.randn(E, H, generator=g).to(dtype))
        biases = biases if act == "clamped_swiglu" else (None, None)
        args = (x, ids, weights, gate_up, down, *biases, act, "eager", 1.702, 0.8)
        want, got = moe_experts(*args), triton_moe_experts(*args)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gpu_kernels_on_a_gpu_keep_a_rows_bits_and_serve_graphs(moe_dirs, dtype):
    """On CUDA: the kernels against the host version; under the invariant row blocks a token's output
    alone equals its row in batches of several sizes; an engine with CUDA graphs (a mixture's forward
    has no host sync there) decodes greedily as the CPU engine does (float32)."""
    from engine.models.moe import moe_experts
    from engine.models.moe_triton import triton_moe_experts

    g = torch.Generator().manual_seed(6)
    E, H, I, k, T = 8, 256, 128, 2, 96  # noqa: E741
    x = torch.randn(T, H, generator=g).to(dtype).cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).cuda()
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).cuda()
    gate_up = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype).cuda()
    down = (0.1 * torch.randn(E, H, I, generator=g)).to(dtype).cuda()
    args = (gate_up, down, None, None, "silu", "invariant")
    got = triton_moe_experts(x, ids, weights, *args)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        got.float(), moe_experts(x, ids, weights, *args[:4], "silu", "eager").float(), atol=tol, rtol=tol
    )
    alone = torch.cat([triton_moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], *args) for t in range(T)])
    for n in (2, 17, 96):
        assert torch.equal(triton_moe_experts(x[:n], ids[:n], weights[:n], *args), alone[:n]), n
    d = moe_dirs["Qwen3MoeForCausalLM"]
    ps = repetitive_prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cpu = [o.outputs[0].delta_token_ids for o in make(d).generate(ps, params)]
    eng = LLMEngine(EngineConfig(model=str(d), device="cuda", dtype="float32", num_kv_blocks=256, block_size=16))
    assert eng.runner.cuda_graph_max_seqs > 0
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == cpu
