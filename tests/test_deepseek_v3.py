"""DeepSeek-V3's architecture (multi-head latent attention over GLM-4.5's mixture), GLM-4.7-Flash's and
DeepSeek-V2's (the same attention over a group-limited softmax router) against transformers on tiny
random checkpoints: logits within float32 tolerance through a chunked prefill and paged decodes, at 1
and 2 ranks; greedy tokens equal to ``generate``; the pool holds one latent per token; in bfloat16 a
request's tokens alone equal its tokens in a batch; speculation exact, its own prediction layer
drafting; served through the SDK."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import check_served
from test_engine import check_logits_parity
from test_moe import build_moe_dir, check_bf16_alone_equals_batch, check_greedy_matches_generate, make
from test_nextn import add_nextn_layer
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits

from engine.models.deepseek_v3 import MlaAttention
from engine.request.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCHS = ["DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV2ForCausalLM"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla")
    return {arch: build_moe_dir(root / arch, tokenizer_dir, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(dirs, arch):
    check_logits_parity(dirs[arch], "cpu")


def test_the_pool_holds_one_latent_per_token(dirs):
    """Every layer's attention caches ``[c; k_rot]`` (48 + 8 values) once for all four heads, where
    per-head keys and values would take 4 x (24 + 12)."""
    eng = make(dirs["DeepseekV3ForCausalLM"])
    model = eng.runner.model
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in model.layers)
    assert eng.runner.kv_cache.shape[1:] == (2, eng.runner.kv_cache.shape[2], 1, 48 + 8)
    assert eng.runner.kv_bytes_per_token == 2 * 4 * 56 * 4  # K and V, 4 layers, float32
    # An FP8 cache's scales: K and V hold the same latent, so both take the larger of a checkpoint's two
    attn = model.layers[0].self_attn
    attn.set_kv_scale("k", torch.tensor(0.5))
    attn.set_kv_scale("v", torch.tensor(2.0))
    assert attn.kv_scales.flatten().tolist() == [2.0, 2.0]
    attn.kv_scales = None
    # The Triton kernel's tiles do not fit the latent's wide head: asked for, it is a clear error (auto
    # takes the sdpa backend on a GPU)
    with pytest.raises(ValueError, match="not built for the triton attention backend"):
        make(dirs["DeepseekV3ForCausalLM"], attention_backend="triton", compile="off")
    # Low-rank queries on DeepSeek-V3's checkpoint, full-rank ones on GLM-4.7-Flash's; its dense layers
    # where mlp_layer_types says
    assert hasattr(model.layers[0].self_attn, "q_b_proj")
    lite = make(dirs["Glm4MoeLiteForCausalLM"]).runner.model
    assert hasattr(lite.layers[0].self_attn, "q_proj")
    assert [type(layer.mlp).__name__ for layer in lite.layers] == ["LlamaMLP", "GroupedSigmoidMoE"] * 2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(dirs, arch):
    check_greedy_matches_generate(dirs[arch])


def test_sharded_logits_match_the_unsharded_model(dirs):
    """-tp 2: each rank holds half of the heads (their queries, their expansion of the latent, their
    part of the output projection) and of every expert; the latent's projections whole. (Within 3e-5: on
    an AVX2 CPU one logit of DeepSeek-V2's 18,432 moved by 1.1e-5, float32 sums in another order.)"""
    ds = [dirs[a] for a in ARCHS]
    for arch, d, sharded in zip(ARCHS, ds, sharded_logits(ds, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=3e-5, msg=lambda m, a=arch: f"{a}: {m}")


def test_in_bfloat16_a_requests_tokens_alone_equal_its_tokens_in_a_batch(dirs):
    """The absorbed products head by head on the batch-invariant operator."""
    eng = make(dirs["DeepseekV3ForCausalLM"], "none", dtype="bfloat16", batch_invariant="on", compile="off")
    assert eng.batch_invariant and eng.runner.model.layers[0].self_attn.invariant
    check_bf16_alone_equals_batch(dirs["DeepseekV3ForCausalLM"], n=10)


@pytest.mark.parametrize(
    "arch,method",
    [("DeepseekV3ForCausalLM", m) for m in ["ngram", "layer-skip", "nextn"]] + [("Glm4MoeLiteForCausalLM", "nextn")],
)
def test_speculation_gives_the_plain_decoders_tokens(dirs, tmp_path, arch, method):
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    target = dirs[arch]
    if method == "nextn":  # its own prediction layer (an MLA layer with a mixture), as the releases ship it
        target = add_nextn_layer(target, tmp_path / "with-layer")
    kw = {"layer-skip": dict(layer_skip_config=write_skip(tmp_path, LayerSkip(frozenset({2}), frozenset({2, 3}))))}
    ps = repetitive_prompts(6, seed=9)
    ps += [ps[0] + [5, 6, 7, 8]]  # a shared prefix: cached blocks reused
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    eng = make(target, method, num_kv_blocks=64, max_num_batched_tokens=40, **kw.get(method, {}))
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_nf4_reads_the_layouts_names(dirs, tmp_path):
    """--quantization nf4 finds each linear under the family's names (``shared_experts``) and, for the
    prediction layer, under the one-layer model's; the layer drafts exactly for the NF4 target."""
    from engine.quant.nf4 import NF4Linear

    target = add_nextn_layer(dirs["DeepseekV3ForCausalLM"], tmp_path / "with-layer")
    ps = repetitive_prompts(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    plain = make(target, quantization="nf4")
    eng = make(target, "nextn", quantization="nf4")
    assert isinstance(plain.runner.model.layers[1].mlp.shared_expert.down_proj, NF4Linear)
    assert isinstance(eng.proposer.head.layers[0].self_attn.q_b_proj, NF4Linear)
    want = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == want


@pytest.mark.gpu
def test_on_a_gpu_latent_attention_runs_on_sdpa_and_matches_transformers(dirs, tmp_path):
    """On CUDA the runner takes the sdpa backend for latent attention; logits within tolerance of
    transformers', and the prediction layer drafts exactly there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = dirs["DeepseekV3ForCausalLM"]
    check_logits_parity(target, "cuda")
    target = add_nextn_layer(target, tmp_path / "with-layer")
    ps = repetitive_prompts(4, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    plain = make(target, device="cuda")
    assert plain.runner.attention_backend == "sdpa"
    want = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    eng = make(target, "nextn", device="cuda")
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == want


@pytest.mark.parametrize("arch", ARCHS)
def test_served_through_the_sdk(dirs, arch):
    check_served(dirs[arch], make(dirs[arch]))


# -- Kimi K2.5's language model ----------------------------------------------------------------------------
def kimi_k25_dir(path: Path, tokenizer_dir: Path, text_dir: Path, released: bool) -> Path:
    """A ``KimiK25ForConditionalGeneration`` checkpoint whose language model is the DeepSeek-V3 one in
    ``text_dir``, a tiny MoonViT vision tower and projector beside it, as transformers saves it (the
    decoder's layers named ``blocks``, the architecture ``Kimi_K25ForConditionalGeneration``) or,
    ``released``, with the released checkpoints' ``layers`` and architecture name, and a
    multi-token-prediction layer past the decoder's (which it never runs)."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from conftest import VOCAB

    torch.manual_seed(1)
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = transformers.Kimi_K25VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
        pos_emb_width=4, pos_emb_time=1,
    )  # fmt: skip
    config = transformers.Kimi_K25Config(
        text_config=text.config.to_dict(), vision_config=vision, projection_hidden_size=32,
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
        vision_end_token_id=VOCAB - 4, tie_word_embeddings=False, architectures=["KimiK25ForConditionalGeneration"],
    )  # fmt: skip
    model = transformers.Kimi_K25ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    if released:
        tensors = load_file(path / "model.safetensors")
        tensors = {
            k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in tensors.items()
        }
        n = config.text_config.num_hidden_layers
        tensors[f"language_model.model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**saved, "architectures": ["KimiK25ForConditionalGeneration"]}))
    return path


def test_kimi_k25_serves_its_language_model(dirs, tmp_path, tokenizer_dir):
    """Kimi K2.5 served as text: its decoder is DeepSeek-V3's, so its logits equal the text-only
    checkpoint's bit for bit, and transformers' multimodal model's within float32 tolerance; the vision
    tower, the projector and a prediction layer are not read; served through the SDK."""
    import transformers
    from families import paged_logits

    from engine.models.deepseek_v3 import KimiK25TextForCausalLM
    from engine.runner.loader import load_config

    text_dir = dirs["DeepseekV3ForCausalLM"]
    ids = list(range(5, 35))
    want = paged_logits(make(text_dir), ids)
    hf = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        kimi_k25_dir(tmp_path / "saved", tokenizer_dir, text_dir, released=False), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    for released in (False, True):
        d = kimi_k25_dir(tmp_path / f"k25-{released}", tokenizer_dir, text_dir, released)
        cfg = load_config(d)
        arch = "KimiK25ForConditionalGeneration" if released else "Kimi_K25ForConditionalGeneration"
        assert cfg.architectures == [arch] and not cfg.tie_word_embeddings
        eng = make(d)
        assert type(eng.runner.model) is KimiK25TextForCausalLM
        got = paged_logits(eng, ids)
        assert torch.equal(got, want), released
        torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
    check_served(d, eng)
