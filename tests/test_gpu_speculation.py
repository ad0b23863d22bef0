"""On CUDA, as served there: every speculative method, through captured CUDA graphs and the triton
attention backend, emits the plain decoder's greedy tokens (GPU-marked; skipped without CUDA).

The CPU suites prove each method exact on CPU; this reruns the serving defaults a GPU switches on
(graphs for decode, draft levels and verify batches; trees of top-k 2; lookahead's and Ouroboros'
wider GPU defaults) against plain decoding on the same device, with preemption and prefix reuse.
"""

from __future__ import annotations

import pytest
from test_spec import (
    check_plain_sampling,
    check_speculative_sampling,
    close_draft,  # noqa: F401 (a fixture)
    noisy_copy,
    small_vocab_pair,  # noqa: F401 (a fixture)
    staggered,
)
from test_step import prompts as repetitive_prompts

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

METHODS = ["draft", "ouroboros", "ngram", "suffix", "lookahead", "layer-skip"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gpu-spec")
    target = build_model_dir(root / "target", tokenizer_dir, "LlamaForCausalLM", std=0.08)
    return target, noisy_copy(target, root / "draft", 0.2)


def engine(target, device: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model=str(target), device=device, dtype="float32", block_size=4, **kw))


def check_methods_match_plain(pair, device: str, methods=METHODS) -> dict[str, float]:
    """Each method's greedy tokens equal plain decoding's on ``device``; returns acceptance lengths."""
    target, draft = pair
    ps = repetitive_prompts(12, seed=5) + repetitive_prompts(4, seed=5)  # the repeats hit the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=4)
    plain = staggered(engine(target, device), ps, params)
    lengths = {}
    for method in methods:
        kw = dict(draft_model=str(draft)) if method in ("draft", "ouroboros") else {}
        eng = engine(target, device, speculative_method=method, num_kv_blocks=48, max_num_batched_tokens=64, **kw)
        assert staggered(eng, ps, params) == plain, method
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, method
        st = eng.spec_stats
        assert st.num_drafts > 0, method
        lengths[method] = 1 + st.num_accepted_tokens / st.num_drafts
    return lengths


def test_every_method_is_exact_through_graphs_on_gpu(pair):
    eng = engine(pair[0], "cuda")
    assert eng.runner.graphs is not None and eng.runner.attention_backend == "triton"
    check_methods_match_plain(pair, "cuda")


def device_waits(eng: LLMEngine, steps: int) -> list[str]:
    """The synchronizing calls of ``steps`` steps, counted with torch's sync debug mode, which warns at
    every one (run 8 steps before: they capture graphs and grow buffers)."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def test_a_decode_step_waits_for_the_device_once(pair):
    """Issue 33, item 3: a plain greedy decode step syncs the host with the device once (the accepted
    tokens' transfer); its forward is timed by CUDA events read after that sync, not by a wait of its
    own. (tests/test_device_waits.py counts the calls that would wait on the CPU.)"""
    eng = engine(pair[0], "cuda")
    eng.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(8):
        eng.step()
    syncs = device_waits(eng, 16)
    assert len(syncs) <= 16, syncs[:4]
    assert eng.runner.graphs is not None  # as served on a GPU


def test_a_drafting_step_waits_for_the_device_twice(pair):
    """A draft model's greedy chains (levels past the first in one graph call): the draft's tokens
    reach the host once, then the accepted ones."""
    eng = engine(pair[0], "cuda", speculative_method="draft", draft_model=str(pair[1]), spec_tree_topk=1)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, num_draft_tokens=3)
    eng.add_request("a", [5, 6, 7, 8, 9, 10], params)
    for _ in range(8):
        eng.step()
    drafts = eng.spec_stats.num_drafts
    syncs = device_waits(eng, 16)
    assert eng.spec_stats.num_drafts - drafts == 16  # every step drafted
    assert len(syncs) <= 2 * 16, syncs[:4]


@pytest.mark.parametrize("topk", [0, 1, 2], ids=["plain", "chains", "trees"])
def test_sampled_tokens_follow_the_target_on_gpu(small_vocab_pair, close_draft, topk, monkeypatch):  # noqa: F811
    """On CUDA, as on the CPU (tests/test_spec.py): plain sampling's inverse-CDF draws and sampled
    speculation's rejection sampling (draft chains, top-2 trees) give the target's exact joint
    distribution of three tokens (a G-test at p ~ 0.001), through graphs and the triton backend, and the
    same test rejects a wrong draw or a wrong rule. In float32, as the exact distribution is computed: a
    GPU's ``dtype=auto`` is bfloat16, whose logits move the probabilities by a few percent, which the
    test sees (it failed so on an H100)."""
    target, draft = small_vocab_pair
    gpu = dict(device="cuda", dtype="float32")
    if topk:
        check_speculative_sampling(target, close_draft, topk, monkeypatch, **gpu)
    else:
        check_plain_sampling(target, draft, monkeypatch, **gpu)


def test_inverse_cdf_draws_match_the_cpu():
    """``verify.draw`` on CUDA picks the same token as on the CPU for the same uniforms, zeros and
    both ends of the unit interval included."""
    import torch

    from engine.sampling.verify import draw

    g = torch.Generator().manual_seed(0)
    P = torch.rand(64, 1000, generator=g, dtype=torch.float64) ** 8
    P[:, ::3] = 0  # massless tokens are never drawn
    P[0] = 0
    P[0, 7] = 1
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[1], u[2] = 0.0, 1.0 - 2**-53
    for dtype in (torch.float32, torch.float64):
        cpu = draw(P.to(dtype), u)
        assert torch.equal(draw(P.to(dtype).cuda(), u.cuda()).cpu(), cpu)
        assert bool((P.gather(1, cpu[:, None]) > 0).all()) and cpu[0].item() == 7
