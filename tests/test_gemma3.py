"""Gemma 3 against transformers on tiny random models: logits, greedy generation (chunked prefill,
requests joining a running batch, sliding windows shorter than the prompts), speculative greedy
identity, two tensor-parallel ranks and one served chat completion.

Two checkpoints of 6 layers: ``text`` a ``Gemma3ForCausalLM`` with the released 5 local : 1 global
pattern and a final soft-cap; ``multimodal`` a ``Gemma3ForConditionalGeneration`` (a tiny vision
tower and projector beside the language model, which Augur serves as text only) with a shorter
pattern of its own. Both rotate local layers with base 10 000 and global layers with base 1 000 000
scaled linearly by 8, as the 4B and larger models do; the scale and base differences change
transformers' logits (checked), so that the parity below proves the two tables are implemented."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import transformers
from families import paged_logits
from safetensors import safe_open
from test_engine import hf_greedy, prompts
from test_step import prompts as repetitive_prompts
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.gemma3 import Gemma3ForCausalLM, Gemma3TextForCausalLM
from engine.models.layer_skip import LayerSkip
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config
from server.app import ServerSettings, create_app
from servers import engine_factory, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a server, a worker and many tiny steps (see conftest)

WINDOW = 8
FAR = 0.05  # a logit difference no implementation error within the parity tolerance (2e-4) explains
ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
LOCAL, GLOBAL = "sliding_attention", "full_attention"
EOS = {"text": [1], "multimodal": [1, 5]}  # the multimodal config's top level sets two
CASES = {
    "text": dict(final_logit_softcapping=1.0),  # layer_types: the default 5 : 1 pattern
    "multimodal": dict(layer_types=[LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL, LOCAL]),
}


def text_config(**overrides) -> dict:
    config = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # not head_dim: the score scale is its own
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rope_parameters=json.loads(json.dumps(ROPE)),  # (the config class edits it in place)
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config.update(overrides)
    return config


def build_gemma3_dir(path: Path, tokenizer_dir: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """A random-weight Gemma 3 (``kind``: ``text`` or ``multimodal``) with the test tokenizer, saved as a
    Hugging Face directory. Norm weights are centred on 0 (Gemma scales by 1 + weight); the embedding
    is drawn small beside the other matrices, else (scaled by sqrt(hidden) and tied to the output)
    it dominates and greedy decoding only repeats the last token."""
    torch.manual_seed(seed)
    if kind == "text":
        config = transformers.Gemma3TextConfig(**text_config(**overrides), architectures=["Gemma3ForCausalLM"])
        model = transformers.Gemma3ForCausalLM(config)
    else:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        config = transformers.Gemma3Config(
            text_config=text_config(**overrides),
            vision_config=dict(vision, image_size=28, patch_size=14),
            mm_tokens_per_image=4,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
            image_token_index=VOCAB - 1,
            eos_token_id=EOS[kind],  # the top level's EOS ids are the engine's (released: <eos>, <end_of_turn>)
            architectures=["Gemma3ForConditionalGeneration"],
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, (0.05 if "embed_tokens" in name else 0.3) if p.dim() > 1 else 0.1)
    model.to(torch.float32).save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    return {
        kind: build_gemma3_dir(tmp_path_factory.mktemp(f"gemma3-{kind}"), tokenizer_dir, kind, **case)
        for kind, case in CASES.items()
    }


@pytest.fixture(scope="module")
def hf_models(gemma_dirs) -> dict:
    return {kind: hf_model(d) for kind, d in gemma_dirs.items()}


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def hf_model(model_dir: Path, **text_overrides):
    """Transformers' model of the directory's architecture (eager attention), its text config changed
    by ``text_overrides``."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    for key, value in text_overrides.items():
        setattr(config.get_text_config(), key, value)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(model_dir, config=config, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy_to_eos(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """Transformers' greedy tokens (``hf_greedy`` stops at id 1) up to and with the first of ``eos``."""
    out = hf_greedy(model, prompt, max_new)
    ends = [i for i, t in enumerate(out) if t in eos]
    return out[: ends[0] + 1] if ends else out


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_checkpoint_layouts_and_the_configs_the_engine_sees(gemma_dirs):
    """transformers 5.24 saves the multimodal checkpoint with the released layout's names; the engine
    sees its text config, with the architecture kept (the registry picks the text tower) and the top
    level's EOS ids."""
    with safe_open(gemma_dirs["multimodal"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in keys
    assert "language_model.model.embed_tokens.weight" in keys
    assert any(k.startswith("vision_tower.") for k in keys) and any(
        k.startswith("multi_modal_projector.") for k in keys
    )
    cfg = load_config(gemma_dirs["multimodal"])
    assert cfg.architectures == ["Gemma3ForConditionalGeneration"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (VOCAB, 64, 6)
    engine = make_engine(gemma_dirs["multimodal"])
    assert type(engine.runner.model) is Gemma3TextForCausalLM
    assert engine.eos_token_ids == EOS["multimodal"]
    for kind, locals_ in (("text", [True] * 5 + [False]), ("multimodal", [True, False, True, True, False, True])):
        model = engine.runner.model if kind == "multimodal" else make_engine(gemma_dirs[kind]).runner.model
        assert [layer.local for layer in model.layers] == locals_
        assert [layer.self_attn.sliding for layer in model.layers] == locals_
        assert model.sliding_window == WINDOW and model.rope_cos.shape == (512, 16)
        assert not torch.equal(model.rope_cos, model.rope_local_cos)


def test_config_choices_are_honoured_or_refused():
    """An attention soft-cap a config sets is applied (transformers' Gemma 3 ignores it; no release sets
    one); a bidirectional config is an encoder, refused."""
    with torch.device("meta"):
        config = transformers.Gemma3TextConfig(**text_config(attn_logit_softcapping=20.0))
        assert {layer.self_attn.softcap for layer in Gemma3ForCausalLM(config).layers} == {20.0}
        with pytest.raises(ValueError, match="use_bidirectional_attention is an encoder"):
            Gemma3ForCausalLM(transformers.Gemma3TextConfig(**text_config(use_bidirectional_attention=True)))


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_match_transformers(gemma_dirs, hf_models, kind):
    """A 30-token prompt (beyond the 8-token window): a 20-token prefill split in two chunks, then
    one token at a time through the paged cache."""
    engine = make_engine(gemma_dirs[kind])
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    expected = hf_logits(hf_models[kind], ids)
    torch.testing.assert_close(paged_logits(engine, ids), expected, atol=2e-4, rtol=2e-4)


def test_both_rope_tables_and_the_cap_change_transformers_logits(gemma_dirs, hf_models):
    """Local layers rotating as the global ones do (or the global ones unscaled), or no final cap, give
    logits far outside the parity tolerance above (``FAR``: 250 times it): that parity holds only
    with each implemented."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    for kind, d in gemma_dirs.items():
        want = hf_logits(hf_models[kind], ids)
        one_table = {LOCAL: dict(ROPE[GLOBAL]), GLOBAL: dict(ROPE[GLOBAL])}
        unscaled = {LOCAL: dict(ROPE[LOCAL]), GLOBAL: {"rope_type": "default", "rope_theta": 1_000_000.0}}
        for rope in (one_table, unscaled):
            assert (hf_logits(hf_model(d, rope_parameters=rope), ids) - want).abs().max() > FAR, (kind, rope)
    capped = hf_logits(hf_models["text"], ids)
    assert capped.abs().max() > 0.6 * CASES["text"]["final_logit_softcapping"]
    uncapped = hf_logits(hf_model(gemma_dirs["text"], final_logit_softcapping=None), ids)
    assert (capped - uncapped).abs().max() > FAR


@pytest.mark.parametrize("kind", list(CASES))
def test_greedy_matches_hf_generate(gemma_dirs, hf_models, kind):
    """Several requests joining a running batch, prefill chunked (48 tokens a step), 4-token blocks."""
    engine = make_engine(gemma_dirs[kind], max_num_batched_tokens=48)
    ps = prompts(5, seed=2, lo=10, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    pending = list(enumerate(ps))
    got: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
            got[i] = []
        for out in engine.step():
            got[int(out.request_id[1:])].extend(out.outputs[0].delta_token_ids)
        step += 1
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy_to_eos(hf_models[kind], p, params.max_tokens, EOS[kind]), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "layer-skip"])
def test_speculative_greedy_is_plain_greedy(gemma_dirs, tmp_path, method):
    """Prompt lookup and the target skipping layers (a local and the global layer's attention, a local
    MLP): verify forwards over sliding windows and both RoPE tables give exactly plain greedy tokens."""
    d = gemma_dirs["text"]
    ps = repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    plain = make_engine(d).generate(ps, params)
    kw = {}
    if method == "layer-skip":
        skip = tmp_path / "skip.json"
        skip.write_text(json.dumps(LayerSkip(frozenset({2, 5}), frozenset({3})).to_dict()))
        kw = dict(layer_skip_config=str(skip), spec_tree_topk=2)
    spec = make_engine(d, speculative_method=method, num_speculative_tokens=3, max_num_batched_tokens=32, **kw)
    got = spec.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in plain]
    assert spec.spec_stats.num_drafts > 0 and spec.spec_stats.num_accepted_tokens > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_two_ranks_decode_as_one_rank_does(gemma_dirs):
    """-tp 2 (a worker process over gloo): each rank its heads, MLP slice and vocabulary slice, q/k
    norms whole; the multimodal checkpoint's prefixed names sliced like the text one's."""
    d = gemma_dirs["multimodal"]
    ps = prompts(1, seed=4, lo=20, hi=21)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = make_engine(d).generate(ps, params)
    engine = make_engine(d, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        got = engine.generate(ps, params)
    finally:
        engine.close()
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in want]


def test_served_chat_completion(gemma_dirs, hf_models):
    """The multimodal checkpoint served as text, through the openai SDK: a chat completion (the test
    tokenizer's chat template) whose tokens are transformers' greedy ones."""
    d = gemma_dirs["multimodal"]
    messages = [{"role": "user", "content": "count: 1 2 3"}]
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = tok.decode(
        hf_greedy_to_eos(hf_models["multimodal"], list(ids), 8, EOS["multimodal"]), skip_special_tokens=True
    )
    assert want.strip()  # (a visible answer: the comparison is not vacuous)
    with serve(create_app(ServerSettings(served_model_name="gemma3"), engine_factory(d))) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="gemma3", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want
