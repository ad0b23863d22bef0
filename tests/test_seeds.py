"""Seeds are a promise: a seeded request's output depends on the model, the prompt, the parameters
and the seed only — the same alone or beside other requests, with speculation on or off, chains or
trees — and it is still a sample of the target's distribution."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

import engine.sampling.accept as accept
from conftest import VOCAB, build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("seeds")
    target = build_model_dir(root / "t", tokenizer_dir, "LlamaForCausalLM", seed=4, std=0.3)
    draft = build_model_dir(root / "d", tokenizer_dir, "LlamaForCausalLM", seed=5, std=0.3, num_hidden_layers=1)
    return target, draft


def make_engine(target, draft=None, **kw) -> LLMEngine:
    cfg = dict(
        model=str(target), device="cpu", num_kv_blocks=256, block_size=4, draft_model=str(draft) if draft else None
    )
    return LLMEngine(EngineConfig(**cfg, **kw))


def run(eng: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[list[int]]]:
    """Every choice's tokens, per request, all submitted together."""
    outs = eng.generate([p for p, _ in requests], [sp for _, sp in requests])
    return [[c.delta_token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


PROMPT = [11, 12, 13, 14, 11, 12]


def others(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8, 1.0]), max_tokens=rng.randint(4, 20), ignore_eos=True)
        if i % 3 == 0:
            params.seed = rng.randrange(2**32)
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("n", [1, 3])
def test_a_seeded_request_is_the_same_alone_under_load_and_with_speculation(pair, temperature, n):
    target, draft = pair
    params = SamplingParams(temperature=temperature, n=n, seed=2024, max_tokens=24, ignore_eos=True)
    plain = make_engine(target)
    alone = run(plain, [(PROMPT, params)])[0]
    assert run(plain, [(PROMPT, params)])[0] == alone
    assert run(plain, [*others(8, 1), (PROMPT, params), *others(8, 2)])[8] == alone
    assert len({tuple(c) for c in alone}) == n, "the choices of one request differ"
    for topk in (1, 2):  # chains, then sampled trees
        spec = make_engine(target, draft, spec_tree_topk=topk)
        drafting = dataclasses.replace(params, num_draft_tokens=3)
        assert run(spec, [(PROMPT, drafting)])[0] == alone
        assert run(spec, [*others(8, 3), (PROMPT, params), *others(8, 4)])[8] == alone
        assert spec.spec_stats.num_drafts > 0
        assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_coupled_drafts_are_accepted_when_the_draft_is_the_target(pair):
    """A draft that is the target samples, with the same noise, what verification samples: all kept."""
    target, _ = pair
    spec = make_engine(target, target, spec_tree_topk=1)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True, num_draft_tokens=3)
    run(spec, [(PROMPT, params)])
    st = spec.spec_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens


def g_statistic(counts: Counter, probs: torch.Tensor, total: int) -> tuple[float, int]:
    """G statistic of observed token counts against ``probs`` (cells with expectation < 5 pooled)."""
    expected = (probs * total).tolist()
    big = [t for t in range(len(expected)) if expected[t] >= 5]
    small = [t for t in range(len(expected)) if expected[t] < 5]
    cells = [(counts.get(t, 0), expected[t]) for t in big]
    cells.append((sum(counts.get(t, 0) for t in small), sum(expected[t] for t in small)))
    g = 2 * sum(o * math.log(o / e) for o, e in cells if o > 0)
    return g, len(cells) - 1


def g_threshold(dof: int, z: float = 3.09) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001).
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def first_tokens(eng: LLMEngine, seeds: range) -> Counter:
    reqs = [(PROMPT, SamplingParams(temperature=1.0, seed=s, max_tokens=1)) for s in seeds]
    return Counter(o[0][0] for o in run(eng, reqs))


def test_seeded_samples_follow_the_target_distribution(pair, monkeypatch):
    target, _ = pair
    eng = make_engine(target, max_num_seqs=256)
    logits = eng.runner.forward([ForwardChunk(PROMPT, 0, [0, 1], 1)]).logits[0]
    probs = torch.softmax(logits, -1)
    seeds = range(4000)
    stat, dof = g_statistic(first_tokens(eng, seeds), probs, len(seeds))
    assert stat < g_threshold(dof), f"G={stat:.1f} dof={dof}"
    # A wrong rule (uniform instead of exponential noise: argmax(p / U) is no sample of p) must fail.
    monkeypatch.setattr(accept, "exponential_noise", lambda probs, gens: torch.rand_like(probs).clamp_min_(1e-12))
    stat, dof = g_statistic(first_tokens(eng, seeds), probs, len(seeds))
    assert stat > g_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"
