"""Gemma-2 against transformers on tiny random models: logits, greedy generation (chunked prefill,
block boundaries, sliding windows shorter than the prompts) and speculative greedy identity.

Two models: ``mild`` has Gemma-2's real caps (50 / 30), which random weights never reach; ``capped``
has larger weights and small caps, so that both soft-caps change the result (checked, so that the
parity below proves the caps are implemented, not merely harmless)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from families import hf_eager as hf_model
from families import hf_logits, paged_logits
from test_engine import hf_greedy, prompts
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

WINDOW = 8
CASES = {
    "mild": dict(std=0.08, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "capped": dict(std=0.5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}


def gemma2_config(**overrides) -> transformers.Gemma2Config:
    config = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        architectures=["Gemma2ForCausalLM"],
    )
    config.update(overrides)
    return transformers.Gemma2Config(**config)


def build_gemma2_dir(path: Path, tokenizer_dir: Path, std: float, seed: int = 0, **overrides) -> Path:
    """A random-weight Gemma-2 with the test tokenizer, saved as a Hugging Face directory. Norm
    weights are centred on 0 (Gemma scales by 1 + weight)."""
    torch.manual_seed(seed)
    config = gemma2_config(**overrides)
    model = transformers.Gemma2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    return {
        name: build_gemma2_dir(tmp_path_factory.mktemp(f"gemma2-{name}"), tokenizer_dir, **case)
        for name, case in CASES.items()
    }


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def test_config_alternates_sliding_and_full_layers(gemma_dirs):
    model = make_engine(gemma_dirs["mild"]).runner.model
    assert model.sliding_window == WINDOW
    assert [layer.self_attn.sliding for layer in model.layers] == [True, False, True, False]
    head = model.lm_head  # tied to the embedding: none, or a layer over the embedding table itself
    assert head is None or head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(gemma_dirs, case):
    """A 30-token prompt (beyond the 8-token window): a 20-token prefill split in two chunks, then
    one token at a time through the paged cache."""
    engine = make_engine(gemma_dirs[case])
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    expected = hf_logits(hf_model(gemma_dirs[case]), ids)
    torch.testing.assert_close(paged_logits(engine, ids), expected, atol=2e-4, rtol=2e-4)


def test_capped_model_needs_both_caps(gemma_dirs):
    """In the ``capped`` model both caps bite: without either, transformers' logits change a lot."""
    d = gemma_dirs["capped"]
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    capped = hf_logits(hf_model(d), ids)
    assert capped.abs().max() > 0.6 * CASES["capped"]["final_logit_softcapping"]
    no_attn_cap = hf_logits(hf_model(d, attn_logit_softcapping=None), ids)
    no_final_cap = hf_logits(hf_model(d, final_logit_softcapping=None), ids)
    assert (capped - no_attn_cap).abs().max() > 0.5
    assert (capped - no_final_cap).abs().max() > 0.5


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_generate(gemma_dirs, case):
    """Several requests joining a running batch, prefill chunked (48 tokens a step), 4-token blocks."""
    engine = make_engine(gemma_dirs[case], max_num_batched_tokens=48)
    ps = prompts(6, seed=2, lo=10, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=12)
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
    ref = hf_model(gemma_dirs[case])
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(ref, p, params.max_tokens), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
def test_speculative_greedy_with_itself_as_draft_is_plain_greedy(gemma_dirs, topk):
    """The model drafting for itself: verify forwards (draft chains or trees masked over sliding
    windows, with soft-capping) must give exactly plain greedy decoding."""
    d = gemma_dirs["capped"]
    ps = prompts(5, seed=3, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    plain = make_engine(d).generate(ps, params)
    spec = make_engine(
        d,
        speculative_method="draft",
        draft_model=str(d),
        num_speculative_tokens=3,
        spec_tree_topk=topk,
        max_num_batched_tokens=32,
    )
    got = spec.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in plain]
    assert spec.spec_stats.num_accepted_tokens > 0


def test_compiled_forward_equals_eager_in_one_graph(gemma_dirs):
    """The soft-capped attention path under ``torch.compile``: the eager numbers, and one graph for
    a decode token, a prefill, a verify chunk and mixed batches (sliding windows included)."""
    path = gemma_dirs["capped"]
    cfg = load_config(path)

    def runner(compiled: bool) -> ModelRunner:
        model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64, pack=False)
        return ModelRunner(model, cfg, torch.device("cpu"), torch.float32, 4, num_blocks=24, compile=compiled)

    eager, compiled = runner(False), runner(True)
    compiled.warmup()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    for shape in ([(1, 13)], [(12, 0)], [(4, 10)], [(1, 11), (3, 2), (9, 0)]):  # (new, cached) per sequence
        chunks = [
            # Block 0 is left out: warmup() wrote it in the compiled runner only.
            ForwardChunk(torch.randint(3, VOCAB, (q,), generator=g).tolist(), ctx, [1 + 5 * i + j for j in range(5)], q)
            for i, (q, ctx) in enumerate(shape)
        ]
        a, b = eager.forward(chunks).logits, compiled.forward(chunks).logits
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
