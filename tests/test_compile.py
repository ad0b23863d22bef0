"""The compiled forward (``--compile on``): the same numbers as the eager one, one graph for every
batch shape, the KV pool written in place, each model with its own frozen weights, and speculation
through it still exactly the plain decoder's greedy output."""

from __future__ import annotations

import pytest
import torch

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

SHAPES = [  # (new tokens, cached tokens) per sequence: decode, prefill, verify chunks, a mixed batch
    [(1, 7)],
    [(9, 0)],
    [(4, 6)],
    [(1, 5), (1, 3), (1, 8)],
    [(3, 2), (1, 9), (6, 0)],
]


def runners(path, compiled: bool, num_blocks: int = 24) -> ModelRunner:
    cfg = load_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64, pack=not compiled)
    return ModelRunner(model, cfg, torch.device("cpu"), torch.float32, 4, num_blocks=num_blocks, compile=compiled)


def chunks_for(shape, seed: int) -> list[ForwardChunk]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (q, ctx) in enumerate(shape):
        ids = torch.randint(3, 300, (q,), generator=g).tolist()
        # Block 0 is left out: warmup() wrote it in the compiled runner only (no sequence owned it).
        out.append(ForwardChunk(ids, ctx, [1 + 4 * i + j for j in range(4)], q))
    return out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_compiled_forward_equals_eager_in_one_graph(model_dirs, arch):
    eager, compiled = runners(model_dirs[arch], False), runners(model_dirs[arch], True)
    compiled.warmup()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, shape in enumerate(SHAPES):
        chunks = chunks_for(shape, seed)
        a, b = eager.forward(chunks).logits, compiled.forward(chunks).logits
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # Every shape above ran on the graphs compiled by warmup(): none was compiled mid-serving.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # The custom attention operator wrote the compiled runner's own pool in place, as eager did.
    written = eager.kv_cache.abs().sum(dim=(0, 1, 3, 4)) > 0
    assert written.any()
    torch.testing.assert_close(compiled.kv_cache[:, :, written], eager.kv_cache[:, :, written], atol=1e-5, rtol=1e-5)


def test_a_compiled_call_gets_few_symbolic_sizes(model_dirs, monkeypatch):
    """Every symbolic size a compiled graph takes is an argument its wrapper converts on each call:
    the KV pool's shape is static but for its slots, the sizes that always equal the token count
    (positions, slot mapping, query index) or each other (the mask's and the key slots' sequences
    and keys) are one size each."""
    from torch._inductor.output_code import CompiledFxGraph

    compiled = runners(model_dirs["LlamaForCausalLM"], True)
    compiled.warmup()
    seen: list[int] = []
    call = CompiledFxGraph.__call__

    def counting(self, inputs):
        seen.append(sum(isinstance(x, int) for x in inputs))
        return call(self, inputs)

    monkeypatch.setattr(CompiledFxGraph, "__call__", counting)
    for seed, shape in enumerate(SHAPES):
        compiled.forward(chunks_for(shape, seed))
    assert seen and all(n > 0 for n in seen)
    # Tokens, sequences, keys, the mask's query width and unit head dim, logit rows, the pool's
    # slots: 7 sizes, and dynamo passes the first name of a size declared equal to another too (at
    # most 3 of those). Unrelated, every tensor dimension is its own size (16 for this call).
    assert max(seen) <= 10, seen
    # loadtest.bench_call times such a call (a decode) and reads the same count.
    from loadtest.bench_call import measure

    cost = measure(compiled, context=6, calls=20)
    assert cost.size_args == seen[0]  # SHAPES[0] is a decode too
    assert cost.graph_ms > 0 and cost.execute_ms > cost.graph_ms


def test_two_models_of_one_shape_keep_their_own_weights(tmp_path, tokenizer_dir):
    """Frozen weights are constants of a graph: a second model of the same architecture (a
    same-shaped draft, a second engine) must get its own graph, not the first one's weights."""
    paths = [build_model_dir(tmp_path / f"m{s}", tokenizer_dir, "LlamaForCausalLM", seed=s) for s in (1, 2)]
    compiled = [runners(p, True) for p in paths]
    chunks = chunks_for(SHAPES[2], 0)
    outs = [r.forward(chunks).logits for r in compiled]
    for path, out in zip(paths, outs):
        torch.testing.assert_close(out, runners(path, False).forward(chunks).logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(outs[0], outs[1])


def test_speculation_through_compiled_forwards_is_exact(tmp_path, tokenizer_dir):
    target = build_model_dir(tmp_path / "t", tokenizer_dir, "LlamaForCausalLM", seed=3, std=0.3)
    draft = build_model_dir(tmp_path / "d", tokenizer_dir, "LlamaForCausalLM", seed=3, std=0.3, num_hidden_layers=1)
    prompts = [[5, 9, 11, 5, 9], [40, 41, 42, 43, 44, 45, 46], [7] * 12]
    # A fixed depth: the controller would rightly stop drafting with a random draft.
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    kw = dict(model=str(target), device="cpu", num_kv_blocks=64, block_size=4)
    plain = LLMEngine(EngineConfig(**kw, compile="off"))
    # Depth 3: chains fuse up to two levels (each length a graph of its own, compiled at start-up).
    spec = LLMEngine(EngineConfig(**kw, compile="on", draft_model=str(draft), num_speculative_tokens=3))
    assert spec.runner.compiled and spec.proposer.runner.compiled

    def run(engine):
        return [o.outputs[0].delta_token_ids for o in engine.generate(prompts, params)]

    assert run(spec) == run(plain)
    assert spec.spec_stats.num_drafts > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_background_compile_serves_without_recompiling(tmp_path, tokenizer_dir):
    """The graphs a server warms up in the background, over its runners' scratch pools, are the ones
    its live pools run: swapped in, no request compiles another (a scratch pool's shape differs from
    the live pool's in its slots only, and both are marked alike). And the swap starts the
    controller's timings afresh (``SpecController.forwards_changed``)."""
    target = build_model_dir(tmp_path / "t", tokenizer_dir, "LlamaForCausalLM", seed=5, std=0.3)
    draft = build_model_dir(tmp_path / "d", tokenizer_dir, "LlamaForCausalLM", seed=5, std=0.3, num_hidden_layers=1)
    kw = dict(model=str(target), device="cpu", num_kv_blocks=64, block_size=4)
    # Depth 2: the draft's chains are of one fused level (the requests below draft 2 tokens; each
    # deeper chain length would be a graph of its own, compiled for nothing).
    engine = LLMEngine(
        EngineConfig(**kw, compile="on", compile_background=True, draft_model=str(draft), num_speculative_tokens=2)
    )
    assert engine.compile_state == "pending"
    engine.compile_in_background().join()
    assert engine.compile_state == "ready"
    # What the eager minutes may have taught the controller, under the compiler's load: drafting off at
    # this batch size for a long while, the exploration budget overdrawn.
    ctl = engine.controller
    stale_guard, stale_cost = ctl.guard, ctl.cost
    bucket = ctl.guard.bucket(1, True)
    bucket.on, bucket.interval, bucket.wait = False, 1024, 1024
    ctl.budget.spent = 1e9
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=2)
    out = engine.generate([[5, 9, 11, 5, 9], [40, 41, 42]], params)
    assert engine.compile_state == "on" and all(o.outputs[0].num_tokens == 12 for o in out)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # The swap started the controller's timings afresh: the stale verdicts are gone (the bucket that was
    # off is on again, the budget is no longer overdrawn), so a request that pins no depth may draft
    # again. Whether it then does is the fresh timings' call, which a test does not assert (it depends
    # on how loaded the machine is).
    assert ctl.guard is not stale_guard and ctl.cost is not stale_cost and ctl.budget.spent < 1e9
    assert ctl.guard.bucket(1, True).on


def test_compile_setting(monkeypatch):
    monkeypatch.delenv("AUGUR_COMPILE", raising=False)
    assert EngineConfig(model="m", device="cpu").compile_enabled
    assert not EngineConfig(model="m", device="cpu", compile="off").compile_enabled
    monkeypatch.setenv("AUGUR_COMPILE", "off")
    assert not EngineConfig(model="m", device="cpu").compile_enabled
    assert EngineConfig(model="m", device="cpu", compile="on").compile_enabled
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(model="m", compile="yes")
