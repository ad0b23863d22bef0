"""Engine core against Hugging Face transformers, on tiny random-weight models built in the tests."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest
import torch

from conftest import ARCHS, VOCAB, build_model_dir, hf_causal_lm
from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import InvalidRequestError, LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(model_dir, device: str = "cpu", **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", **kw))


def hf_model(model_dir, device="cpu"):
    return hf_causal_lm(model_dir, dtype=torch.float32).to(device).eval()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]


def hf_greedy(model, prompt: list[int], max_new: int, device="cpu") -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=1,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


def run_staggered(
    engine: LLMEngine, ps: list[list[int]], params: SamplingParams, every: int = 2
) -> dict[str, list[int]]:
    """Add one request every ``every`` steps, so requests join a running batch mid-flight."""
    pending = list(enumerate(ps))
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].delta_token_ids)
            if out.finished:
                done.add(out.request_id)
        step += 1
    assert done == set(tokens)
    return tokens


# -- model parity ------------------------------------------------------------------------------------
def check_logits_parity(model_dir, device: str) -> None:
    engine = make_engine(model_dir, device=device)
    ref = hf_model(model_dir, device)
    runner = engine.runner
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids], device=device)).logits[0].float()
    table = engine.block_manager.fork([]) or []
    assert engine.block_manager.reserve(table, 0, len(ids)) is not None
    # Prefill the first 20 tokens (all logits), then decode the rest one at a time through the cache.
    got = [runner.forward([ForwardChunk(ids[:20], 0, table, num_logits=20)]).logits]
    for t in range(20, len(ids)):
        got.append(runner.forward([ForwardChunk(ids[t : t + 1], t, table, num_logits=1)]).logits)
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs, arch):
    check_logits_parity(model_dirs[arch], "cpu")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_each_mlp_activation_matches_transformers(tmp_path, tokenizer_dir, act):
    """The activations named in configs, ours (engine.models.invariant.ACTIVATIONS) against transformers';
    one it does not know is a clear error."""
    check_logits_parity(build_model_dir(tmp_path / act, tokenizer_dir, "LlamaForCausalLM", hidden_act=act), "cpu")


def test_an_unknown_mlp_activation_is_a_clear_error(tmp_path, tokenizer_dir):
    d = build_model_dir(tmp_path / "m", tokenizer_dir, "LlamaForCausalLM", hidden_act="gelu_new")
    with pytest.raises(ValueError, match="activation 'gelu_new' is not supported"):
        make_engine(d)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_cuda(model_dirs, arch):
    check_logits_parity(model_dirs[arch], "cuda")


def test_mixed_batch_equals_separate_forwards(llama_dir):
    """Prefill chunks and decode tokens of different sequences in one flat batch give each its own logits."""
    engine = make_engine(llama_dir)
    runner, bm = engine.runner, engine.block_manager
    a, b = prompts(2, seed=3, lo=10, hi=20)
    ta, tb = [], []
    bm.reserve(ta, 0, len(a))
    bm.reserve(tb, 0, len(b))
    runner.forward([ForwardChunk(a[:-1], 0, ta, 0)])
    mixed = runner.forward([ForwardChunk(a[-1:], len(a) - 1, ta, 1), ForwardChunk(b, 0, tb, 1)]).logits
    ref = hf_model(llama_dir)
    with torch.no_grad():
        ea = ref(torch.tensor([a])).logits[0, -1]
        eb = ref(torch.tensor([b])).logits[0, -1]
    torch.testing.assert_close(mixed, torch.stack([ea, eb]), atol=2e-4, rtol=2e-4)


def test_unsupported_architecture_is_clear(tmp_path, tokenizer_dir):
    from conftest import build_model_dir

    d = build_model_dir(tmp_path / "m", tokenizer_dir, "LlamaForCausalLM")
    cfg = (d / "config.json").read_text().replace('"LlamaForCausalLM"', '"GPT2LMHeadModel"')
    (d / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        make_engine(d)


def test_missing_hub_model_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="some-org/not-cached"):
        make_engine("some-org/not-cached")


# -- continuous batching ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_continuous_batching_matches_hf_generate(model_dirs, arch):
    engine = make_engine(model_dirs[arch], max_num_batched_tokens=48)  # forces chunked prefill
    ps = prompts(9, seed=2)
    got = run_staggered(engine, ps, GREEDY)
    ref = hf_model(model_dirs[arch])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, GREEDY.max_tokens), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_keeps_outputs(llama_dir):
    ps = prompts(8, seed=4, lo=10, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    roomy = run_staggered(make_engine(llama_dir), ps, params)
    tight = make_engine(llama_dir, num_kv_blocks=24, enable_prefix_caching=False)  # 96 token slots
    preempted = []
    orig = tight.scheduler._preempt

    def spy(seq, out):
        preempted.append(seq.seq_id)
        orig(seq, out)

    tight.scheduler._preempt = spy
    got = run_staggered(tight, ps, params, every=1)
    assert preempted, "the pool was meant to be too small for all requests at once"
    assert got == roomy
    assert all(len(v) == 20 for v in got.values())
    assert tight.block_manager.num_free_blocks == 24


def test_prefix_caching_reuses_blocks(llama_dir):
    engine = make_engine(llama_dir)
    shared = prompts(1, seed=5, lo=33, hi=34)[0]  # 8 full blocks of 4, plus one token
    tails = prompts(3, seed=6, lo=2, hi=6)
    first = engine.generate([shared + tails[0]], GREEDY)[0]
    queried0, hits0 = engine.block_manager.prefix_cache_stats
    outs = engine.generate([shared + t for t in tails[1:]], GREEDY)
    queried, hits = engine.block_manager.prefix_cache_stats
    assert hits - hits0 == 2 * 8  # both later requests reuse the 8 shared full blocks
    plain = make_engine(llama_dir, enable_prefix_caching=False)
    expected = plain.generate([shared + t for t in tails], GREEDY)
    assert plain.block_manager.prefix_cache_stats[1] == 0
    assert [o.outputs[0].delta_token_ids for o in [first, *outs]] == [o.outputs[0].delta_token_ids for o in expected]


# -- sampling through the engine ------------------------------------------------------------------------
def test_seed_reproducible_whatever_the_batch(llama_dir):
    p = prompts(1, seed=7)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = make_engine(llama_dir).generate([p], params)[0].outputs[0].delta_token_ids
    others = prompts(5, seed=8)
    mates = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 5
    crowded = make_engine(llama_dir).generate(others[:2] + [p] + others[2:], mates[:2] + [params] + mates[2:])
    assert crowded[2].outputs[0].delta_token_ids == alone
    other_seed = make_engine(llama_dir).generate(
        [p], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16)
    )
    assert other_seed[0].outputs[0].delta_token_ids != alone


def test_n_choices_share_prompt_blocks(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts(1, seed=9, lo=30, hi=31)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("multi", p, params)
    engine.step()  # prefill + fork
    group = engine.groups["multi"]
    assert len(group.seqs) == 3
    full_prompt_blocks = len(p) // 4
    for b in group.seqs[0].block_table[:full_prompt_blocks]:
        assert engine.block_manager.ref_count(b) == 3
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.num_tokens == 6 for c in final.outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_are_raw_model_logprobs(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts(1, seed=10)[0]
    out = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    lps = out.outputs[0].delta_logprobs
    ref = hf_model(llama_dir)
    with torch.no_grad():
        first = torch.log_softmax(ref(torch.tensor([p])).logits[0, -1], -1)
    assert lps[0].token_id == out.outputs[0].delta_token_ids[0]
    assert lps[0].logprob == pytest.approx(first.max().item(), abs=1e-4)
    assert [t for t, _ in lps[0].top] == torch.topk(first, 2).indices.tolist()


# -- stopping -----------------------------------------------------------------------------------------
def test_stop_conditions(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts(1, seed=11)[0]
    free = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and free.num_tokens == 12
    # A stop token id: the fifth generated token.
    stop_id = free.delta_token_ids[4]
    first = free.delta_token_ids.index(stop_id)
    o = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True))
    c = o[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.num_tokens) == ("stop", stop_id, first + 1)
    # A stop string taken from the middle of the text (the first 3 characters there that are not all
    # blank); the output is cut right before it.
    text = free.text
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i : i + 3].strip())
    c = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    c = c.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)] and c.num_tokens < 12
    # Context length.
    short = make_engine(llama_dir, max_model_len=len(p) + 5)
    c = short.generate([p], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert (c.finish_reason, c.num_tokens) == ("length", 5)


def test_a_stop_string_before_min_tokens_does_not_stop_the_output(llama_dir):
    """vLLM's rule: stop strings are not looked for until the output has its ``min_tokens``; one that
    ended before does not stop it later, one that ends after does."""
    engine = make_engine(llama_dir)
    p = prompts(1, seed=11)[0]
    free = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text, ids = free.text, free.delta_token_ids
    early = text[: len(engine.tokenizer.decode(ids[:2]))].strip()[:3]  # in the first two tokens' text
    assert early and text.count(early) == 1
    plain = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop=[early], ignore_eos=True))
    assert plain[0].outputs[0].finish_reason == "stop" and plain[0].outputs[0].num_tokens <= 2
    late = SamplingParams(temperature=0.0, max_tokens=12, stop=[early], ignore_eos=True, min_tokens=4)
    c = engine.generate([p], late)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text, c.delta_token_ids) == ("length", None, text, ids)
    # A stop string that ends after min_tokens still stops the output there.
    tail = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i : i + 3].strip())
    c = engine.generate([p], dataclasses.replace(late, stop=[early, tail]))[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", tail, text[: text.index(tail)])


def test_eos_stops_unless_ignored(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts(1, seed=12)[0]
    eos_first = {1: 100.0}  # EOS (id 1) becomes the greedy choice at every step
    c = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=eos_first))[0].outputs[0]
    assert (c.finish_reason, c.delta_token_ids) == ("stop", [1])
    c = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=eos_first, ignore_eos=True))
    assert (c[0].outputs[0].finish_reason, c[0].outputs[0].delta_token_ids) == ("length", [1] * 8)
    c = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=eos_first, min_tokens=3))
    toks = c[0].outputs[0].delta_token_ids
    assert len(toks) == 4 and toks[-1] == 1 and 1 not in toks[:3]


def test_invalid_requests(llama_dir):
    engine = make_engine(llama_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("b", [5, VOCAB + 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request("c", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks(llama_dir):
    engine = make_engine(llama_dir)
    for i, p in enumerate(prompts(3, seed=13)):
        engine.add_request(f"x{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(3):
        assert engine.abort(f"x{i}")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and engine.step() == []


# -- async engine and CLI ---------------------------------------------------------------------------
def test_async_engine_streams_and_aborts(llama_dir):
    engine = make_engine(llama_dir)
    ps = prompts(4, seed=14)
    expected = [o.outputs[0].delta_token_ids for o in engine.generate(ps, GREEDY)]
    aeng = AsyncEngine(engine)
    aeng.start()

    async def one(i, p):
        toks = []
        async for out in aeng.generate(f"a{i}", p, GREEDY):
            toks.extend(out.outputs[0].delta_token_ids)
        return toks

    async def leave_early():
        async for out in aeng.generate("quitter", ps[0], SamplingParams(max_tokens=200, ignore_eos=True)):
            if out.outputs[0].num_tokens >= 3:
                break

    async def main():
        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)), leave_early())
        for _ in range(100):  # the abort lands within one engine step
            if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
                break
            await asyncio.sleep(0.02)
        return got[:4]

    try:
        assert asyncio.run(main()) == expected
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        aeng.shutdown()


def test_generate_cli_prints_only_completion(llama_dir):
    engine = make_engine(llama_dir)
    expected = engine.generate(["def foo(x):"], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].text
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--model", str(llama_dir), "--device", "cpu",
         "--num-kv-blocks", "64", "--prompt", "def foo(x):", "--max-tokens", "10", "--log-level", "INFO"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected.rstrip("\n")
    assert "KV pool" in proc.stderr  # logs go to stderr, never stdout
