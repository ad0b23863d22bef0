"""gpt-oss against transformers on tiny random checkpoints: attention sinks, alternating sliding and
full layers, YaRN RoPE, the biased router and clamped-SwiGLU experts; the MXFP4 experts as OpenAI
ships them; -tp 2; speculation exact on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from families import check_served, hf_logits, paged_logits
from families import hf_eager as hf_model
from safetensors.torch import load_file, save_file
from test_engine import hf_greedy, prompts, run_staggered
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.llama import LlamaForCausalLM
from engine.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8


def gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        swiglu_limit=0.5,  # (7 on the real models, which random weights never reach: here the clamp bites)
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip
    config.update(overrides)
    return transformers.GptOssConfig(**config)


def build_dir(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    config = gpt_oss_config(**overrides)
    model = transformers.GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(1.0 if p.shape[0] == config.hidden_size and "norm" in name else 0.0, 0.05)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


def as_mxfp4(src: Path, dst: Path) -> tuple[Path, Path]:
    """(the checkpoint with its experts in MXFP4, as OpenAI ships them; the same weights in bfloat16
    layout, dequantized: what transformers should compute for it)."""
    import shutil

    shutil.copytree(src, dst)
    ref = dst.parent / f"{dst.name}-dequantized"
    shutil.copytree(src, ref)
    w = load_file(src / "model.safetensors")
    packed, plain = {}, {}
    for name, t in w.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # stored [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            plain[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        else:
            packed[name] = plain[name] = t
    save_file(packed, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, ref / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dir(tmp_path_factory.mktemp("gpt-oss") / "m", tokenizer_dir)


def make(model_dir, method: str | None = None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", speculative_method=method, **kw))


def our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    return paged_logits(make(model_dir), ids)


def test_layers_alternate_and_hold_sinks(oss_dir):
    model = make(oss_dir).runner.model
    assert isinstance(model, LlamaForCausalLM) and model.sliding_window == WINDOW
    assert [layer.self_attn.sliding for layer in model.layers] == [True, False, True, False]
    assert all(layer.self_attn.sinks.shape == (4,) for layer in model.layers)


def test_a_config_without_the_swiglu_constants_gets_the_models_own():
    """transformers 5.17's GptOssConfig has neither ``swiglu_alpha`` nor ``swiglu_limit`` (the lent GPU's
    image has it): the model takes gpt-oss's 1.702 and 7.0 rather than failing to build."""
    from engine.models import model_class_for

    class OlderConfig(transformers.GptOssConfig):
        def __getattribute__(self, name):
            if name in ("swiglu_alpha", "swiglu_limit"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    config = OlderConfig(**gpt_oss_config().to_dict())
    assert not hasattr(config, "swiglu_limit") and not hasattr(config, "swiglu_alpha")
    with torch.device("meta"):
        model = model_class_for(config)(config, 64)
    assert {(layer.mlp.alpha, layer.mlp.limit) for layer in model.layers} == {(1.702, 7.0)}


def test_logits_match_transformers(oss_dir):
    """A 30-token prompt, longer than the 8-token window."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    torch.testing.assert_close(our_logits(oss_dir, ids), hf_logits(hf_model(oss_dir), ids), atol=2e-4, rtol=2e-4)


def test_the_sinks_and_the_clamp_matter(oss_dir, tmp_path):
    """So that parity proves them: transformers' logits move when the sinks are taken out (-inf: no
    share) and when the SwiGLU's limit is lifted."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    ref = hf_logits(hf_model(oss_dir), ids)
    model = hf_model(oss_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
    assert (hf_logits(model, ids) - ref).abs().max() > 1e-2
    assert (hf_logits(hf_model(oss_dir, swiglu_limit=1000.0), ids) - ref).abs().max() > 1e-3


def test_greedy_matches_hf_generate(oss_dir):
    engine = make(oss_dir, max_num_batched_tokens=40)
    ps = prompts(5, seed=2, lo=10, hi=40)
    got = run_staggered(engine, ps, SamplingParams(temperature=0.0, max_tokens=10))
    ref = hf_model(oss_dir)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, 10), i


def test_mxfp4_experts_load_as_shipped(oss_dir, tmp_path):
    """The MXFP4 checkpoint serves the weights it encodes: its logits are transformers' on the same
    weights dequantized (MXFP4 values are exact in bfloat16 and float32)."""
    packed, dequantized = as_mxfp4(oss_dir, tmp_path / "mxfp4")
    assert "quantization_config" in json.loads((packed / "config.json").read_text())
    ids = prompts(1, seed=3, lo=30, hi=31)[0]
    ours = our_logits(packed, ids)
    torch.testing.assert_close(ours, hf_logits(hf_model(dequantized), ids), atol=2e-4, rtol=2e-4)
    assert (ours - hf_logits(hf_model(oss_dir), ids)).abs().max() > 1e-3  # (quantizing did change them)
    with pytest.raises(ValueError, match="cannot be re-quantized"):
        load_model(packed, load_config(packed), torch.float32, torch.device("cpu"), 64, quantization="int4")


def test_sharded_logits_match_the_unsharded_model(oss_dir, tmp_path, tokenizer_dir):
    """-tp 2, bfloat16-layout and MXFP4 experts (interleaved gate/up rows split per rank; the down
    projection's MXFP4 blocks split along their inner groups: inner size 32 per rank), sinks by head."""
    packed, _ = as_mxfp4(build_dir(tmp_path / "wide", tokenizer_dir, intermediate_size=64), tmp_path / "wide-mxfp4")
    dirs = [oss_dir, packed]
    for d, sharded in zip(dirs, sharded_logits(dirs, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=str(d))


@pytest.mark.parametrize("method", ["ngram", "suffix", "layer-skip"])
def test_speculation_gives_the_plain_decoders_tokens(oss_dir, tmp_path, method):
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(oss_dir).generate(ps, params)]
    kw = {}
    if method == "layer-skip":
        kw["layer_skip_config"] = write_skip(tmp_path, LayerSkip(frozenset({2}), frozenset({1, 2})))
    eng = make(oss_dir, method, num_kv_blocks=64, max_num_batched_tokens=40, **kw)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain
    assert eng.spec_stats.num_drafts > 0


def test_served_through_the_sdk(oss_dir):
    check_served(oss_dir, make(oss_dir))
