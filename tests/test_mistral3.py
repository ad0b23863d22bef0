"""Mistral 3 against transformers on tiny random models: Ministral 3's text checkpoint
(``Ministral3ForCausalLM``) and the language model of ``Mistral3ForConditionalGeneration`` checkpoints
(a tiny Pixtral vision tower and projector beside it, served as text only), one with Ministral 3's
text config and a tied output layer, one with Mistral's (Mistral Small 3.1 / 3.2's) and its own head.

Ministral 3's queries are scaled by position after RoPE (Llama 4's attention temperature, from
``llama_4_scaling_beta``); the tests' original context is 8 positions, so the scale steps up inside
a 30-token prompt (and changes transformers' logits: checked), and its RoPE is YaRN's, as released.
Checked: logits through a chunked prefill and paged decodes, greedy tokens with requests joining a
running batch, speculative greedy identity, two tensor-parallel ranks, and a served completion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from families import check_served, hf_logits, paged_logits, save_random
from safetensors import safe_open
from test_engine import hf_greedy, prompts, run_staggered
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.mistral3 import Ministral3ForCausalLM, Mistral3TextForCausalLM
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAR = 0.05  # a logit difference no implementation error within the parity tolerance (2e-4) explains
ORIGINAL = 8  # Ministral 3's original context here: the query scale steps up at positions 8, 24, ...
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip
ROPE = {  # Ministral 3's released RoPE parameters, at this scale (512 positions = 64 x 8)
    "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 64.0, "original_max_position_embeddings": ORIGINAL,
    "llama_4_scaling_beta": 0.5, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
KINDS = ["ministral3", "multimodal-ministral3", "multimodal-mistral"]


def build_dir(path: Path, tokenizer_dir: Path, kind: str, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``kind`` with the test tokenizer, saved by transformers: the
    Ministral 3 text model, or a Mistral 3 multimodal one with Ministral 3's text config (its output
    layer tied, as the config's top level says by default) or Mistral's (untied: its own head)."""
    torch.manual_seed(seed)
    if kind == "ministral3":
        config = transformers.Ministral3Config(**COMMON, rope_parameters=ROPE, architectures=["Ministral3ForCausalLM"])
        model = transformers.Ministral3ForCausalLM(config)
    else:
        ministral = kind == "multimodal-ministral3"
        text = (
            transformers.Ministral3Config(**COMMON, rope_parameters=ROPE)
            if ministral
            else transformers.MistralConfig(**COMMON)
        )
        vision = transformers.PixtralVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
            image_size=28, patch_size=14,
        )  # fmt: skip
        config = transformers.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=VOCAB - 1, tie_word_embeddings=ministral,
            architectures=["Mistral3ForConditionalGeneration"],
        )  # fmt: skip
        model = transformers.Mistral3ForConditionalGeneration(config)
    return save_random(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mistral3")
    return {kind: build_dir(root / kind, tokenizer_dir, kind) for kind in KINDS}


def hf_model(model_dir: Path, **rope_overrides):
    """Transformers' model of the directory's architecture (eager attention), its text config's RoPE
    parameters changed by ``rope_overrides``."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    text.rope_parameters = {**text.rope_parameters, **rope_overrides}
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(model_dir, config=config, dtype=torch.float32, attn_implementation="eager").eval()


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 128, "block_size": 4, "dtype": "float32", **kw}
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **kw))


def test_checkpoints_and_what_the_engine_sees(dirs):
    """The multimodal checkpoints carry the released layout's names beside a vision tower and a
    projector; the engine sees the text config (the architecture kept: the registry picks the text
    tower), ties the output layer where the checkpoint has no head of its own, and scales queries only
    where the text config gives ``llama_4_scaling_beta``."""
    for kind, head in (("multimodal-ministral3", False), ("multimodal-mistral", True)):
        with safe_open(dirs[kind] / "model.safetensors", "pt") as f:
            keys = set(f.keys())
        assert "language_model.model.embed_tokens.weight" in keys
        assert ("language_model.lm_head.weight" in keys) == head
        assert any(k.startswith("vision_tower.") for k in keys) and any(
            k.startswith("multi_modal_projector.") for k in keys
        )
        cfg = load_config(dirs[kind])
        assert cfg.architectures == ["Mistral3ForConditionalGeneration"] and cfg.tie_word_embeddings != head
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (VOCAB, 64, 4)
    models = {kind: make_engine(d).runner.model for kind, d in dirs.items()}
    assert type(models["ministral3"]) is Ministral3ForCausalLM
    assert type(models["multimodal-mistral"]) is Mistral3TextForCausalLM
    assert models["ministral3"].scaled == models["multimodal-ministral3"].scaled == (0.5, ORIGINAL)
    assert models["multimodal-mistral"].scaled is None
    assert models["multimodal-ministral3"].tie_word_embeddings and not models["multimodal-mistral"].tie_word_embeddings
    scale = models["ministral3"].rope_query_scale
    assert scale[:ORIGINAL].eq(1).all() and scale[ORIGINAL] > 1 and scale[3 * ORIGINAL] > scale[ORIGINAL]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(dirs, kind):
    """A 30-token prompt (past three steps of the query scale): a 20-token prefill in two chunks, then
    one token at a time through the paged cache."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    expected = hf_logits(hf_model(dirs[kind]), ids)
    torch.testing.assert_close(paged_logits(make_engine(dirs[kind]), ids), expected, atol=2e-4, rtol=2e-4)


def test_the_query_scale_changes_transformers_logits(dirs):
    """Without the query scale (beta 0) transformers' logits move far beyond the parity's tolerance:
    the parity above holds only with it implemented."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    for kind in ("ministral3", "multimodal-ministral3"):
        want = hf_logits(hf_model(dirs[kind]), ids)
        unscaled = hf_logits(hf_model(dirs[kind], llama_4_scaling_beta=0.0), ids)
        assert (unscaled - want).abs().max() > FAR, kind


@pytest.mark.parametrize("kind", ["ministral3", "multimodal-mistral"])
def test_greedy_matches_hf_generate(dirs, kind):
    """Requests joining a running batch every other step, prefill chunked (32 tokens a step)."""
    engine = make_engine(dirs[kind], max_num_batched_tokens=32)
    ps = prompts(4, seed=2, lo=10, hi=36)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    got = run_staggered(engine, ps, params)
    ref = hf_model(dirs[kind])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, params.max_tokens), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculative_greedy_is_plain_greedy(dirs):
    """Verify forwards of n-gram lookups and of the model drafting for itself with its middle layers
    skipped, at positions past the query scale's steps, emit exactly the plain greedy tokens."""
    d = dirs["multimodal-ministral3"]
    ps = repetitive_prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    plain = [o.outputs[0].delta_token_ids for o in make_engine(d).generate(ps, params)]
    accepted = 0
    for method in ("ngram", "layer-skip"):
        eng = make_engine(d, speculative_method=method, max_num_batched_tokens=32)
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain, method
        assert eng.spec_stats.num_drafts > 0, method
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, method
        accepted += eng.spec_stats.num_accepted_tokens
    assert accepted > 0, "some drafts must be right, or the accepting path went untested"


def test_two_ranks_give_one_ranks_logits(dirs):
    """At 2 ranks (each its heads, MLP slice and vocabulary slice; the multimodal checkpoints' prefixed
    names cut like a text one's) every checkpoint's logits are 1 rank's."""
    for kind, sharded in zip(KINDS, sharded_logits([dirs[k] for k in KINDS], 2), strict=True):
        for want, have in zip(model_logits(dirs[kind]), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-4, msg=kind)  # (sums over ranks)


def test_nf4_is_refused_for_the_multimodal_checkpoint(dirs):
    d = dirs["multimodal-mistral"]
    with pytest.raises(ValueError, match="cannot load a Mistral3ForConditionalGeneration checkpoint"):
        load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, quantization="nf4")


QUANT = Path(__file__).parent / "fixtures" / "quant"


def as_multimodal(src: Path, out: Path) -> Path:
    """``src`` (a quantized text-only checkpoint of tests/fixtures/quant/, written by its format's tool)
    rewritten as a ``Mistral3ForConditionalGeneration`` one: its tensors under the language model's
    prefixes beside a vision tensor, its config the text config of a multimodal one, the quantization
    config at the top level, and a ``consolidated.safetensors`` of Mistral's own layout beside it (not
    read)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = {f"language_model.{k}": v for k, v in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.patch_conv.weight"] = torch.ones(4, 3, 2, 2)
    save_file(tensors, out / "model.safetensors")
    save_file({"tok_embeddings.weight": torch.ones(2, 2)}, out / "consolidated.safetensors")
    text = json.loads((src / "config.json").read_text())
    quantization = text.pop("quantization_config")
    text.pop("architectures")
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14}  # fmt: skip
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
              "vision_config": vision, "image_token_index": VOCAB - 1, "tie_word_embeddings": False,
              "quantization_config": quantization}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("fixture", "quantization"), [("ct-fp8-block", None), ("gptq-4bit-g32-sym", "int4")])
def test_a_quantized_multimodal_checkpoint_loads_as_its_text_only_self(tmp_path, fixture, quantization):
    """The quantization config at a multimodal checkpoint's top level is the language model's: its FP8
    weights dequantize as they load, and under --quantization int4 its GPTQ groups are served as they
    are stored (filed by the text names); the vision tensor and Mistral's own file are never read. The
    logits are the text-only checkpoint's."""
    src = tmp_path / "text"
    shutil.copytree(QUANT / fixture, src, ignore=shutil.ignore_patterns("reference.safetensors"))
    multimodal = as_multimodal(src, tmp_path / "multimodal")
    cfg = load_config(multimodal)
    assert cfg.quantization_config and cfg.architectures == ["Mistral3ForConditionalGeneration"]

    def logits(d: Path) -> list[torch.Tensor]:
        return model_logits(d, quantization=quantization)

    for want, got in zip(logits(src), logits(multimodal), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["ministral3", "multimodal-mistral"])
def test_served_through_the_sdk(dirs, kind):
    check_served(dirs[kind], make_engine(dirs[kind]))
