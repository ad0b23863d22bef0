"""On CUDA, as served there: every speculative method, through captured CUDA graphs and the triton
attention backend, emits the plain decoder's greedy tokens (GPU-marked; skipped without CUDA).

The CPU suites prove each method exact on CPU; this reruns the serving defaults a GPU switches on
(graphs for decode, draft levels and verify batches; trees of top-k 2; lookahead's and Ouroboros'
wider GPU defaults) against plain decoding on the same device, with preemption and prefix reuse.
"""

from __future__ import annotations

import pytest
from test_spec import noisy_copy, staggered
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


def test_a_decode_step_waits_for_the_device_once(pair):
    """Issue 33, item 3: a plain greedy decode step syncs the host with the device once (the accepted
    tokens' transfer); its forward is timed by CUDA events read after that sync, not by a wait of its
    own. Counted with torch's sync debug mode, which warns at every synchronizing call."""
    import warnings

    import torch

    eng = engine(pair[0], "cuda")
    eng.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(8):  # the prefill and the first decodes (graphs captured, buffers grown)
        eng.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(16):
                eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 16, [str(w.message) for w in syncs[:4]]
    assert eng.runner.graphs is not None  # as served on a GPU
