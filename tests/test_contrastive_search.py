"""Contrastive search (``penalty_alpha``, ``top_k``) against a small reference built on transformers.

The reference recomputes everything from scratch each step with the Hugging Face model: the top-k
candidates of the (no-repeat-processed) next-token distribution, each candidate's final-normed
hidden state from its own full forward, and the score ``(1 - alpha) * p - alpha * max cos`` against
every earlier token's state. The engine must pick the same tokens while it feeds the candidates as
siblings of one step, under preemption, and next to speculating requests whose greedy output stays
what it is alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
import transformers
from test_engine import make_engine
from test_server import assert_error

from conftest import build_model_dir
from engine.request.sampling_params import SamplingParams
from engine.sampling.no_repeat import banned_in
from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [30, 31]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    # Sharper weights than the default tiny model, so greedy decoding repeats and the penalty matters.
    return build_model_dir(tmp_path_factory.mktemp("cs-model"), tokenizer_dir, "LlamaForCausalLM", std=0.3)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference(hf, prompt: list[int], alpha: float, k: int, no_repeat: int = 0) -> list[int]:
    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        states = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [L, H] final-normed
        context = torch.nn.functional.normalize(states, dim=-1)
        logits = hf.lm_head(states[-1])
        for t in banned_in(ids, no_repeat) if no_repeat else ():
            logits[t] = float("-inf")
        probs, cands = torch.softmax(logits, -1).topk(k)
        scores = []
        for p, c in zip(probs, cands.tolist()):
            h = hf.model(torch.tensor([ids + [c]])).last_hidden_state[0, -1]
            scores.append((1 - alpha) * p - alpha * (context @ torch.nn.functional.normalize(h, dim=-1)).max())
        ids.append(cands[int(torch.stack(scores).argmax())].item())
    return ids[len(prompt) :]


def search(alpha: float, k: int, no_repeat: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        penalty_alpha=alpha,
        top_k=k,
        no_repeat_ngram_size=no_repeat,
    )


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

ENGINES = {
    "plain": {},
    # 12 blocks of 4 slots: the three searches (k candidates each) and three greedy requests preempt one another.
    "tight-pool": dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_model_len=48),
    "speculating": "draft",
}


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_contrastive_search_matches_the_reference(engine_kind, model_dir, hf, monkeypatch):
    kw = ENGINES[engine_kind]
    if kw == "draft":  # the model drafting for itself: greedy requests beside the searches speculate
        kw = dict(speculative_method="draft", draft_model=str(model_dir), num_speculative_tokens=3)
    engine = make_engine(model_dir, **kw)
    preemptions = []
    preempt = engine.scheduler.preempt
    monkeypatch.setattr(engine.scheduler, "preempt", lambda seq: (preemptions.append(seq), preempt(seq))[1])
    greedy = [o.outputs[0].delta_token_ids for o in engine.generate(PROMPTS, GREEDY)]  # each alone first
    for alpha, k, no_repeat in [(0.6, 4, 0), (0.3, 2, 0), (0.9, 6, 2)]:
        greedy_params = [dataclasses.replace(GREEDY, num_draft_tokens=3 if kw else None)] * len(PROMPTS)
        outs = engine.generate(PROMPTS + PROMPTS, [search(alpha, k, no_repeat)] * len(PROMPTS) + greedy_params)
        got = [o.outputs[0].delta_token_ids for o in outs]
        assert got[: len(PROMPTS)] == [reference(hf, p, alpha, k, no_repeat) for p in PROMPTS], (alpha, k)
        assert got[len(PROMPTS) :] == greedy  # the requests beside them are untouched
        assert got[: len(PROMPTS)] != greedy  # the penalty acted: this is not greedy decoding
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if engine_kind == "tight-pool":
        assert preemptions, "the tight pool should have preempted someone"
    if engine_kind == "speculating":
        assert engine.spec_stats.num_draft_tokens > 0


def test_penalty_alpha_zero_keeps_greedy_and_bad_combinations_are_refused(model_dir):
    engine = make_engine(model_dir)
    plain = engine.generate(PROMPTS, GREEDY)
    same = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, top_k=4))
    assert [o.outputs[0].delta_token_ids for o in plain] == [o.outputs[0].delta_token_ids for o in same]
    for bad, match in [
        (dict(top_k=1), "chooses among top_k >= 2 candidates, got top_k 1"),
        (dict(top_k=4, n=2), "contrastive search is deterministic: n > 1"),
        (dict(top_k=4, top_p=0.5), "top_p does not apply to contrastive search"),
        (dict(top_k=4, logprobs=1), "logprobs does not apply to contrastive search"),
        (dict(top_k=4, use_beam_search=True, best_of=2), "contrastive search combines with no other search"),
        (dict(top_k=4, penalty_alpha=1.5), r"penalty_alpha must be in \[0, 1\], got 1.5"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**{"penalty_alpha": 0.5, **bad})


@pytest.fixture(scope="module")
def served(model_dir) -> Iterator[Served]:
    with serve(create_app(ServerSettings(served_model_name="cs"), engine_factory(model_dir))) as s:
        yield s


def test_contrastive_search_over_http(served, model_dir, hf):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    with openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        out = client.completions.create(
            model="cs",
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            top_p=1.0,
            extra_body={"penalty_alpha": 0.6, "top_k": 4, "ignore_eos": True},
        )
    want = reference(hf, PROMPTS[1], 0.6, 4)
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert out.usage.completion_tokens == MAX_TOKENS
    with httpx.Client(base_url=served.base, timeout=60) as http:
        body = {"model": "cs", "prompt": "Hi", "max_tokens": 4, "penalty_alpha": 0.5}
        assert_error(http.post("/v1/completions", json={**body, "top_k": 1}), 400, contains="top_k")
        assert_error(http.post("/v1/completions", json={**body, "top_k": 4, "n": 2}), 400, contains="n > 1")
        assert_error(http.post("/v1/completions", json={**body, "top_k": 4, "penalty_alpha": 2}), 400)
        assert_error(http.post("/v1/completions", json={**body, "top_k": 100000}), 400, contains="vocabulary")
