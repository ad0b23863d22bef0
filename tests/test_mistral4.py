"""Mistral 4 (Mistral Small 4: DeepSeek-V3's latent attention and mixture, with a softmax router limited
to the best expert groups and queries scaled by position) against transformers on tiny random
checkpoints, as transformers saves them (each layer's experts stacked): ``Mistral4ForCausalLM`` and the
language model of a ``Mistral3ForConditionalGeneration`` checkpoint whose text config is Mistral 4's.

The tests' original context is 8 positions, so the query scale steps up inside a prompt; 12 experts in 4
groups, each token's 3 from its best 2 groups. Checked: logits through a chunked prefill and paged decodes
(and that both the scale and the group limit move transformers' logits far past the tolerance), greedy
tokens equal to ``generate``, two tensor-parallel ranks, a request's bfloat16 tokens alone and in a
batch, speculation exact, and a served completion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from families import check_served, hf_eager, hf_logits, paged_logits, save_random
from test_engine import prompts
from test_moe import (
    build_moe_dir,
    check_bf16_alone_equals_batch,
    check_greedy_matches_generate,
    check_speculation_is_plain,
    make,
    moe_config,
)
from tp_ranks import model_logits, sharded_logits

from engine.models.mistral4 import Mistral4ForCausalLM, Mistral4TextForCausalLM, ScaledMlaAttention, SoftmaxGroupedMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "Mistral4ForCausalLM"
FAR = 0.05  # a logit difference no implementation error within the parity tolerance (2e-4) explains


def multimodal_dir(path: Path, tokenizer_dir: Path) -> Path:
    """A ``Mistral3ForConditionalGeneration`` checkpoint with Mistral 4's text config and a tiny Pixtral
    tower, its own output layer."""
    torch.manual_seed(1)
    text = moe_config(ARCH)
    vision = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=text.vocab_size - 1, tie_word_embeddings=False,
        architectures=["Mistral3ForConditionalGeneration"],
    )  # fmt: skip
    return save_random(transformers.Mistral3ForConditionalGeneration(config), path, tokenizer_dir, std=0.08)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mistral4")
    return {
        "text": build_moe_dir(root / "text", tokenizer_dir, ARCH),
        "multimodal": multimodal_dir(root / "mm", tokenizer_dir),
    }


def test_the_engine_builds_mistral_4(dirs):
    """The text checkpoint and the multimodal one each get their class; latent attention with scaled
    queries, layer 0 dense and the others mixtures routed by softmax; the RoPE tables are the rotated
    part's width (8 of a 24-wide head)."""
    for kind, cls in (("text", Mistral4ForCausalLM), ("multimodal", Mistral4TextForCausalLM)):
        model = make(dirs[kind]).runner.model
        assert type(model) is cls and model.scaled == (0.5, 8)
        assert all(isinstance(layer.self_attn, ScaledMlaAttention) for layer in model.layers)
        assert [type(layer.mlp).__name__ for layer in model.layers] == ["LlamaMLP"] + ["SoftmaxGroupedMoE"] * 3
        assert model.rope_cos.shape[1] == 8


@pytest.mark.parametrize("kind", ["text", "multimodal"])
def test_logits_match_transformers(dirs, kind):
    """A 30-token prompt (past two steps of the query scale): a 20-token prefill in two chunks, then one
    token at a time through the paged cache."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    expected = hf_logits(hf_eager(dirs[kind]), ids)
    torch.testing.assert_close(paged_logits(make(dirs[kind]), ids), expected, atol=2e-4, rtol=2e-4)


def test_the_query_scale_and_the_group_limit_change_transformers_logits(dirs):
    """Without the query scale (beta 0), or with every group open, transformers' logits move far beyond
    the parity's tolerance: the parity above holds only with both implemented."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    want = hf_logits(hf_eager(dirs["text"]), ids)
    config = transformers.AutoConfig.from_pretrained(dirs["text"])
    unscaled = hf_logits(
        hf_eager(dirs["text"], rope_parameters={**config.rope_parameters, "llama_4_scaling_beta": 0.0}), ids
    )
    assert (unscaled - want).abs().max() > FAR
    assert (hf_logits(hf_eager(dirs["text"], topk_group=4), ids) - want).abs().max() > FAR


def test_routing_by_group(dirs):
    """Each token's experts come from two groups only (of four), the two whose two best probabilities sum
    highest; the weights are the chosen probabilities renormalized, times the scaling factor."""
    moe = make(dirs["text"]).runner.model.layers[1].mlp
    assert isinstance(moe, SoftmaxGroupedMoE)
    x = torch.randn(64, 64)
    ids, weights = moe.route(x)
    probs = torch.softmax(moe.gate(x).float(), -1)
    best_groups = probs.view(64, 4, 3).topk(2, -1).values.sum(-1).topk(2, -1).indices
    assert all(set((ids[t] // 3).tolist()) <= set(best_groups[t].tolist()) for t in range(64))
    chosen = probs.gather(1, ids)
    torch.testing.assert_close(weights, 2.0 * chosen / chosen.sum(-1, keepdim=True))


def test_greedy_matches_hf_generate(dirs):
    check_greedy_matches_generate(dirs["text"])


def test_sharded_logits_match_the_unsharded_model(dirs):
    """-tp 2: each rank its half of the heads and of every expert's inner rows (cut from the stacked
    experts as they load)."""
    ds = [dirs["text"], dirs["multimodal"]]
    for d, sharded in zip(ds, sharded_logits(ds, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=3e-5)


def test_in_bfloat16_a_requests_tokens_alone_equal_its_tokens_in_a_batch(dirs):
    check_bf16_alone_equals_batch(dirs["text"])


@pytest.mark.parametrize("method", ["ngram", "layer-skip"])
def test_speculation_gives_the_plain_decoders_tokens(dirs, tmp_path, method):
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    kw = {"layer-skip": dict(layer_skip_config=write_skip(tmp_path, LayerSkip(frozenset({2}), frozenset({2, 3}))))}
    check_speculation_is_plain(dirs["text"], method, **kw.get(method, {}))


def test_served_through_the_sdk(dirs):
    check_served(dirs["multimodal"], make(dirs["multimodal"]))


def test_default_rope_is_refused(tmp_path, tokenizer_dir):
    """Transformers' default tables would be a whole head's width where RoPE turns its rotated part: such a
    config is a clear error (the releases turn by YaRN)."""
    config = moe_config(ARCH)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="Mistral 4 with default RoPE is not supported"):
        Mistral4ForCausalLM(config, 64)


def fp8_release(src: Path, out: Path, reference: Path) -> None:
    """``src`` as Mistral's FP8 release stores it: every linear layer's weight in e4m3 with one multiplier
    for the tensor (``weight_scale_inv``, no blocks) and a static activation scale, each stack of experts
    in e4m3 with one multiplier an expert (``gate_up_proj_scale_inv [E, 1, 1]``) and an activation scale;
    the router, norms, embeddings and head as they were. ``reference``: the same checkpoint with the
    dequantized values in float32 (what loading the FP8 one must give)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    fp8, plain = {}, {}
    for name, t in tensors.items():
        stacked = name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
        linear = name.endswith("_proj.weight") and ".layers." in name
        if not (stacked or linear):
            fp8[name] = plain[name] = t
            continue
        dims = (1, 2) if stacked else (0, 1)
        scale = t.abs().amax(dim=dims, keepdim=True) / 448.0
        q = (t / scale).to(torch.float8_e4m3fn)
        plain[name] = q.float() * scale
        fp8[name] = q
        if stacked:
            fp8[name + "_scale_inv"], fp8[name + "_activation_scale"] = scale, torch.ones(())
        else:
            fp8[name.removesuffix("weight") + "weight_scale_inv"] = scale.reshape(())
            fp8[name.removesuffix("weight") + "input_scale"] = torch.ones(())
    for d, ts in ((out, fp8), (reference, plain)):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(ts, d / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "static"}
    (out / "config.json").write_text(json.dumps(config))


def test_the_fp8_release_layout_loads_as_its_dequantized_values(dirs, tmp_path):
    """Per-tensor ``weight_scale_inv`` (no blocks) and stacked experts with a scale an expert, as Mistral's
    FP8 release stores them: the logits are those of the dequantized checkpoint, at one rank and two."""
    fp8, reference = tmp_path / "fp8", tmp_path / "reference"
    fp8_release(dirs["text"], fp8, reference)
    want = model_logits(reference)
    for have in (model_logits(fp8), sharded_logits([fp8], 2)[0]):
        for w, h in zip(want, have, strict=True):
            torch.testing.assert_close(h, w, rtol=1e-5, atol=3e-5)
