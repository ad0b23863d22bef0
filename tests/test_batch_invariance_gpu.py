"""The batch-invariant mode on CUDA (``--batch-invariant on``; engine/models/invariant_cuda.py), GPU-marked:
a row of a linear layer keeps its bits in a batch of any size (where cuBLAS's do not: the control), a
query's attention output is the same in a decode, a verify and a prefill, and an engine on the demo
target gives a request the same greedy tokens and seeded samples alone, in batches mixed with other
requests' prefills and decodes, and with speculation at a pinned depth, in bfloat16 and float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_batch_invariance import DRAFT, PARAMS, PROMPTS, TARGET, run, staggered

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.runner.model_runner import ForwardChunk

pytestmark = pytest.mark.gpu


def make(dtype: str, invariant: str = "on", **kw) -> LLMEngine:
    kw.setdefault("speculative_method", "none")
    return LLMEngine(EngineConfig(model=str(TARGET), device="cuda", dtype=dtype, batch_invariant=invariant, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_of_the_linear_kernel_keeps_its_bits_in_any_batch(dtype):
    from engine.models import invariant_cuda

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", generator=g).to(dtype)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) / 64).to(dtype)  # split over K (k_splits > 1)
    assert invariant_cuda.k_splits(4096, 4096, x.device) > 1
    full = invariant_cuda.invariant_linear(x, w)
    for lo, hi in [(0, 1), (7, 8), (5, 9), (64, 70), (3, 200), (0, 300)]:
        assert torch.equal(invariant_cuda.invariant_linear(x[lo:hi], w), full[lo:hi]), (lo, hi)
    if dtype != torch.bfloat16:
        return
    # The control (bfloat16): cuBLAS's own product picks its kernel by the rows, and some row's bits move.
    ref = torch.nn.functional.linear(x, w)
    moved = [(lo, hi) for lo, hi in [(0, 1), (7, 8), (5, 9), (3, 200)] if not torch.equal(torch.nn.functional.linear(
        x[lo:hi], w), ref[lo:hi])]  # fmt: skip
    assert moved, "cuBLAS gave every row the same bits in every batch: this control checks nothing here"


def test_a_querys_attention_is_the_same_in_a_decode_a_verify_and_a_prefill():
    """The demo target's logits for a token through the whole forward (linear layers, norms, attention):
    the prompt's last token prefilled with the prompt, decoded after it, verified with four tokens more,
    and decoded beside other sequences."""
    eng = make("bfloat16")
    runner = eng.runner
    ids = eng.tokenizer.encode(PROMPTS[0])[:40]
    n = len(ids)
    table = list(range(100, 100 + -(-(n + 8) // eng.config.block_size)))
    other = list(range(200, 200 + len(table)))
    with torch.inference_mode():
        whole = runner.forward([ForwardChunk(ids, 0, table, 1)]).logits[-1]
        runner.forward([ForwardChunk(ids[:-1], 0, table, 1)])
        decode = runner.forward([ForwardChunk(ids[-1:], n - 1, table, 1)]).logits[-1]
        verify = runner.forward([ForwardChunk(ids[-1:] + [5, 6, 7, 8], n - 1, table, 5)]).logits[0]
        runner.forward([ForwardChunk(ids[:-1], 0, other, 1)])
        beside = runner.forward([ForwardChunk([9, 10, 11], 0, list(range(300, 310)), 1),
                                 ForwardChunk(ids[-1:], n - 1, table, 1),
                                 ForwardChunk(ids[-1:], n - 1, other, 1)]).logits  # fmt: skip
    assert torch.equal(decode, whole) and torch.equal(verify, whole)
    assert torch.equal(beside[1], whole) and torch.equal(beside[2], whole)


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    eng = make("float32", "off")
    return [eng.tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_a_request_alone_and_in_batches_of_any_size(ids, dtype, name):
    eng = make(dtype)
    assert eng.batch_invariant and eng.runner.graphs is not None  # as served: captured graphs
    params = PARAMS[name]
    alone = [run(eng, [i], params)[0] for i in ids]
    for size in (2, 5, len(ids)):
        assert run(eng, ids[:size], params) == alone[:size], size
    assert staggered(eng, ids, params) == alone
    assert run(make(dtype, max_num_batched_tokens=48), ids, params) == alone  # prefills in other chunks


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_gives_plain_decodings_tokens(ids, method):
    reference = {name: [run(make("bfloat16"), [i], p)[0] for i in ids[:6]] for name, p in PARAMS.items()}
    kw = {"draft_model": str(DRAFT)} if method == "draft" else {}
    eng = make("bfloat16", speculative_method=method, num_speculative_tokens=4, **kw)
    for name, params in PARAMS.items():
        pinned = dataclasses.replace(params, num_draft_tokens=3)
        assert run(eng, ids[:6], pinned) == reference[name], name
        assert staggered(eng, ids[:6], pinned) == reference[name], name
    assert eng.spec_stats.num_draft_tokens > 0
