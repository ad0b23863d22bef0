"""Tensor parallelism on CPU with gloo (issue 36): each rank a real process, tiny random-weight models
of every family.

- A sharded model's logits equal the unsharded model's (fp32, 1e-5 relative), at 2 ranks and at 4
  (fewer KV heads than ranks: replicated), for prefill chunks and decodes over the paged KV cache.
- An engine at --tensor-parallel-size 2 (rank 0 drives a worker process) greedily emits what the
  engine at 1 emits, plain and speculating, with preemption and prefix reuse.
- What a size cannot do is a clear error at start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from test_gemma2 import build_gemma2_dir
from test_spec import (  # noqa: F401
    exact_joint,
    g_statistic,
    g_test_threshold,
    noisy_copy,
    sample_counts,
    small_vocab_pair,
    staggered,
)
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits, weight_bytes

from conftest import ARCHS, VOCAB, build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.parallel import free_port
from engine.sampling import verify as verify_mod
from server.app import ServerSettings, create_app
from servers import engine_factory, serve, wait_until

FAMILIES = [*ARCHS, "Gemma2ForCausalLM", "Llama with biases"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tp-models")
    dirs = {arch: build_model_dir(root / arch, tokenizer_dir, arch) for arch in ARCHS}
    dirs["Gemma2ForCausalLM"] = build_gemma2_dir(root / "gemma2", tokenizer_dir, std=0.08)
    # Biases on every projection, o_proj's and down_proj's among them (row-parallel: rank 0 adds them).
    dirs["Llama with biases"] = build_model_dir(
        root / "biased", tokenizer_dir, "LlamaForCausalLM", attention_bias=True, mlp_bias=True
    )
    return dirs


def test_sharded_logits_match_the_unsharded_model_for_every_family(family_dirs, tmp_path):
    """Every family's logits at 2 ranks equal 1 rank's; so do the drafters --draft-tensor-parallel-size
    shards: Medusa heads (output layers split by vocabulary, residual blocks whole) and an EAGLE head
    (its layer as the target's, biases included, its reduced draft vocabulary split, the target's
    sharded embedding)."""
    from test_eagle import write_eagle
    from test_medusa import write_heads as medusa_heads

    llama = family_dirs["LlamaForCausalLM"]
    drafters = [
        ("medusa", medusa_heads(llama, tmp_path / "medusa"), llama),
        (
            "eagle",
            write_eagle(llama, tmp_path / "eagle", draft_vocab=VOCAB // 2, attention_bias=True, mlp_bias=True),
            llama,
        ),
    ]
    dirs = [family_dirs[a] for a in FAMILIES] + drafters
    got = sharded_logits(dirs, 2)
    for arch, d, sharded in zip([*FAMILIES, "Medusa heads", "EAGLE head"], dirs, got, strict=True):
        for want, have in zip(model_logits(d), sharded):
            assert have.shape == want.shape, arch
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=arch)


def test_a_rank_holds_about_half_the_weights(family_dirs):
    """Each of 2 ranks holds its slices only: about half of the model's parameter bytes (the norms are
    replicated, and so nothing else at this shape)."""
    d = family_dirs["LlamaForCausalLM"]
    (sharded,) = sharded_logits([d], 2, weights=True)
    whole = weight_bytes(load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False))
    assert 0.45 * whole <= sharded <= 0.55 * whole


@pytest.mark.parametrize("quantization", ["nf4", "int4"])
def test_quantized_weights_shard_as_their_blocks_allow(tmp_path, tokenizer_dir, quantization):
    """--quantization under -tp: each rank quantizes its own slices. Where a slice's rows are whole
    blocks (NF4's 64 values, int4's groups of 128; real models' widths make them so), its blocks are
    the unsharded model's; this model's slices at 2 ranks are 128 and 256 wide. NF4 dequantizes and
    multiplies in float32: the logits are 1 rank's. int4's kernels return bfloat16, so each rank's
    partial sums are rounded before the all-reduce: the logits differ from 1 rank's by bf16 rounding,
    which must stay far below what quantizing costs (int4 against full precision)."""
    shape = dict(hidden_size=256, intermediate_size=512)
    d = build_model_dir(tmp_path / "wide", tokenizer_dir, "LlamaForCausalLM", **shape)
    (sharded,) = sharded_logits([d], 2, quantization=quantization)
    one, full = model_logits(d, quantization=quantization), model_logits(d)
    for want, have, exact in zip(one, sharded, full):
        if quantization == "nf4":
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        else:
            sharding, quantizing = (have - want).abs().max(), (want - exact).abs().max()
            assert sharding < 0.25 * quantizing, (sharding, quantizing)


def test_four_ranks_replicate_key_value_heads(family_dirs):
    """4 ranks over a model with 2 KV heads: each KV head is held by two ranks."""
    d = family_dirs["LlamaForCausalLM"]
    (sharded,) = sharded_logits([d], 4)
    for want, have in zip(model_logits(d), sharded):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_a_size_the_model_cannot_use_is_a_clear_error(family_dirs):
    from engine.parallel import TensorParallel

    d = family_dirs["LlamaForCausalLM"]  # 4 heads, 2 KV heads, a vocabulary of 384
    with pytest.raises(ValueError, match="does not divide the model's attention heads"):
        load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, tp=TensorParallel(0, 3, ""))
    with pytest.raises(ValueError, match="is neither a divisor nor a multiple of the model's 3 key/value heads"):
        TensorParallel(0, 4, "").kv_heads(3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(model=str(d), tensor_parallel_size=0)


def test_a_drafter_the_ranks_cannot_share_is_a_clear_error(family_dirs, tmp_path, tokenizer_dir):
    """--draft-tensor-parallel-size 2 with a draft of one attention head: the start-up error names the
    draft, and the engine that failed stops its worker and leaves the group (another one starts)."""
    d = family_dirs["LlamaForCausalLM"]
    one_head = build_model_dir(
        tmp_path / "one-head", tokenizer_dir, "LlamaForCausalLM", num_attention_heads=1, num_key_value_heads=1
    )
    want = r"--draft-tensor-parallel-size 2: the draft model cannot be sharded: .* attention heads \(1\)"
    with pytest.raises(ValueError, match=want):
        _engine(d, 2, speculative_method="draft", draft_model=str(one_head), draft_tensor_parallel_size=2)
    _engine(d, 2).close()


def _engine(model_dir, tp: int, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 64, "compile": "off", "block_size": 4, "dtype": "float32", **kw}
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, **kw))


def test_an_engine_at_two_ranks_decodes_as_one_rank_does(family_dirs, tmp_path):
    """Greedy output at 2 ranks equals 1 rank's, plain and with each proposer: a lookup, lookahead's
    Jacobi window through the sharded target, the sharded target skipping layers, a draft model on rank
    0 alone, Medusa heads on rank 0, MTP heads reaching the sharded embedding and output layer through
    the runner, an EAGLE head with a whole copy of the embedding on rank 0; a draft model sharded like
    the target (--draft-tensor-parallel-size 2), with chains and with trees, and drafting Ouroboros'
    phrases; Medusa heads and an EAGLE head sharded the same way; under a pool small enough to preempt,
    with repeated prompts hitting the prefix cache."""
    from test_eagle import write_eagle
    from test_medusa import write_heads as medusa_heads
    from test_mtp import write_heads as mtp_heads

    d = family_dirs["LlamaForCausalLM"]
    drafts = {
        "draft": noisy_copy(d, tmp_path / "draft", 0.2),
        "medusa": medusa_heads(d, tmp_path / "medusa", like_target=True),
        "mtp": mtp_heads(d, tmp_path / "mtp"),
        "eagle": write_eagle(d, tmp_path / "eagle"),
    }
    ps = repetitive_prompts(6, seed=5) + repetitive_prompts(2, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    want = staggered(_engine(d, 1), ps, params)
    sharded = {"draft_tensor_parallel_size": 2, "draft_model": str(drafts["draft"]), "speculative_method": "draft"}
    methods = ("none", "ngram", "lookahead", "layer-skip", "draft", "medusa", "mtp", "eagle")
    cases = [{"speculative_method": m} for m in methods]
    cases += [sharded, {**sharded, "spec_tree_topk": 2}, {**sharded, "speculative_method": "ouroboros"}]
    cases += [{"speculative_method": m, "draft_tensor_parallel_size": 2} for m in ("medusa", "eagle")]
    drafted = {}  # (method, draft ranks) -> (drafts, drafted tokens, accepted tokens)
    for kw in cases:
        method = kw["speculative_method"]
        kw = {"draft_model": str(drafts[method]), **kw} if method in drafts else kw
        eng = _engine(d, 2, num_kv_blocks=20, max_num_batched_tokens=48, **kw)
        try:
            if "draft_tensor_parallel_size" in kw:  # the drafter's own shard on each rank, driven like the target
                model = eng.proposer.heads.module if method == "medusa" else eng.proposer.runner.model
                assert model.tp.size == 2 and model.tp.rank == 0
            assert staggered(eng, ps, params) == want, kw
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, kw
            if method != "none":
                assert eng.spec_stats.num_drafts > 0, kw
            st = eng.spec_stats
            drafted[method, kw.get("draft_tensor_parallel_size", 1), kw.get("spec_tree_topk")] = (
                st.num_drafts,
                st.num_draft_tokens,
                st.num_accepted_tokens,
            )
        finally:
            eng.close()
    # Exactness holds whatever a drafter proposes: that a sharded drafter proposes what the unsharded one
    # does shows in the same drafts accepted the same way.
    for method in ("draft", "medusa", "eagle"):
        assert drafted[method, 2, None] == drafted[method, 1, None], method


def test_a_step_is_one_message_to_the_workers(family_dirs, tmp_path, monkeypatch):
    """Draft trees (whose accepted nodes move in the KV pool) from a draft model on rank 0: each
    step's KV moves ride with the next step's forward, so the workers get at most one message a step;
    the output stays 1 rank's."""
    from engine.runner.parallel import Workers

    d = family_dirs["LlamaForCausalLM"]
    draft = noisy_copy(d, tmp_path / "draft", 0.2)
    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    kw = dict(draft_model=str(draft), spec_tree_topk=2)
    want = staggered(_engine(d, 1, **kw), ps, params)
    eng = _engine(d, 2, **kw)
    sends, moves, send, defer = [], [], Workers.send, Workers.defer
    monkeypatch.setattr(
        Workers, "send", lambda self, key, name, *a, **k: sends.append(name) or send(self, key, name, *a, **k)
    )
    monkeypatch.setattr(Workers, "defer", lambda self, key, name, *a: moves.append(name) or defer(self, key, name, *a))
    steps = eng.step
    count = []
    monkeypatch.setattr(eng, "step", lambda: count.append(1) or steps())
    try:
        assert staggered(eng, ps, params) == want
    finally:
        eng.close()
    assert "move_slots" in moves  # trees moved accepted nodes, and those went with the next messages
    assert len(sends) - 1 <= len(count)  # (the last message: shutdown)


def _tp_samples(target, draft, params: SamplingParams, prompt: list[int], n: int) -> dict:
    """Counts of the first 3 tokens of ``n`` sampled choices at 2 ranks, a draft model speculating."""
    eng = _engine(target, 2, draft_model=str(draft), num_kv_blocks=4096, max_num_seqs=1024, block_size=8)
    try:
        counts = sample_counts(eng, params, prompt, n)
        assert eng.spec_stats.num_drafts > 0
    finally:
        eng.close()
    return counts


def test_sampled_output_at_two_ranks_follows_the_target(small_vocab_pair, monkeypatch, tmp_path):  # noqa: F811
    """The G-test of test_spec at 2 ranks (a draft model on rank 0, rejection sampling there, from the
    gathered logits); a deliberately wrong rule (after a rejection, p again instead of the residual)
    fails it. A far draft and a flat target: many rejections, many cells."""
    target, _ = small_vocab_pair
    draft = noisy_copy(target, tmp_path / "far", 2.0)
    params = SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True, num_draft_tokens=3)
    prompt, n = [0, 3, 4, 5], 20_480
    expected = exact_joint(target, prompt, params)
    stat, dof = g_statistic(_tp_samples(target, draft, params, prompt, n), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    monkeypatch.setattr(verify_mod, "reject_residual", lambda P_, q_: P_)
    stat, dof = g_statistic(_tp_samples(target, draft, params, prompt, n), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def _greedy_with_gaps(eng: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and, at each position, the gap between its top two logprobs (the
    top two logits' gap: both are shifted by the same log-normalizer)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = eng.generate(prompts, params)
    return [
        (o.outputs[0].delta_token_ids, [lp.top[0][1] - lp.top[1][1] for lp in o.outputs[0].delta_logprobs])
        for o in outs
    ]


def test_two_ranks_match_one_rank_up_to_near_ties(family_dirs, record_property):
    """The all-reduce sums in another order, which can flip a token where the top two logits nearly
    tie. Each request's tokens at 2 ranks (float32) equal 1 rank's up to the first position where 1
    rank's top two logits lie within 1e-4 (the whole output where there is none); such positions are
    reported (the test's ``near_ties`` property), not hidden. (In bfloat16 the logits' own resolution,
    2^-7 here, is the gap at which tokens flip: such a run diverged at a gap of one bf16 step.)"""
    d = family_dirs["Qwen3ForCausalLM"]
    ps = repetitive_prompts(16, seed=3)
    one = _greedy_with_gaps(_engine(d, 1), ps)
    eng = _engine(d, 2)
    try:
        two = _greedy_with_gaps(eng, ps)
    finally:
        eng.close()
    ties = []
    for i, ((want, gaps), (have, _)) in enumerate(zip(one, two)):
        stop = next((j for j, g in enumerate(gaps) if g < 1e-4), len(want))
        if stop < len(want):
            ties.append((i, stop))
        assert have[: stop + 1] == want[: stop + 1], f"prompt {i} differs before its first near-tie ({stop})"
    record_property("near_ties", ties)


def test_compiled_forwards_at_two_ranks(family_dirs):
    """torch.compile traces the collectives into the graphs of every rank (the CPU default)."""
    d = family_dirs["Qwen2ForCausalLM"]
    ps = repetitive_prompts(3, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = staggered(_engine(d, 1), ps, params)
    eng = _engine(d, 2, compile="on")
    try:
        assert eng.compile_state == "on"
        assert staggered(eng, ps, params) == want
    finally:
        eng.close()


def _served_answers(srv) -> list:
    c = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in ("def add(a, b):", [5, 6, 7, 8, 5, 6, 7, 8, 5]):
        r = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        out.append(r.choices[0].text)
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count: 1 2 3"}], max_tokens=16, temperature=0, stream=True
    )
    out.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    return out


@pytest.fixture(scope="module")
def one_rank_answers(family_dirs) -> list:
    """What the Llama answers served at one rank (``_served_answers``)."""
    with serve(
        create_app(ServerSettings(served_model_name="tiny"), engine_factory(family_dirs["LlamaForCausalLM"]))
    ) as srv:
        assert httpx.get(srv.base + "/version").json()["tensor_parallel_size"] == 1
        return _served_answers(srv)


@pytest.mark.parametrize("front", ["thread", "process"])
def test_served_greedy_output_at_two_ranks_equals_one_rank(family_dirs, tmp_path, front, one_rank_answers):
    """Through a real server and the openai SDK: -tp 2 answers as -tp 1 does, plain and speculating
    with the engine on a thread (a draft model on rank 0, and a draft model, Medusa heads and an EAGLE
    head each sharded like the target), and speculating with the engine in a process of its own (which
    starts the worker)."""
    from test_eagle import write_eagle
    from test_medusa import write_heads as medusa_heads

    d, want = family_dirs["LlamaForCausalLM"], one_rank_answers
    settings = ServerSettings(served_model_name="tiny")
    draft = noisy_copy(d, tmp_path / "draft", 0.2)
    configs = [{"speculative_method": "draft", "draft_model": str(draft)}]
    if front == "thread":  # (the message path is the same in both fronts: the process front runs the draft only)
        sharded = [
            {"speculative_method": "draft", "draft_model": str(draft)},
            {
                "speculative_method": "medusa",
                "draft_model": str(medusa_heads(d, tmp_path / "medusa", like_target=True)),
            },
            {"speculative_method": "eagle", "draft_model": str(write_eagle(d, tmp_path / "eagle"))},
        ]
        configs += [{}] + [{**kw, "draft_tensor_parallel_size": 2} for kw in sharded]
    for kw in configs:
        factory = engine_factory(d, tensor_parallel_size=2, num_kv_blocks=128, **kw)
        if front == "process":
            factory = _process_factory(d, tensor_parallel_size=2, **kw)
        with serve(create_app(settings, factory)) as srv:
            assert _served_answers(srv) == want, kw
            assert httpx.get(srv.base + "/version").json()["tensor_parallel_size"] == 2
            info = 'augur_engine_info{model_name="tiny",tensor_parallel_size="2"} 1.0'
            assert info in httpx.get(srv.base + "/metrics").text


def _process_factory(model_dir, **kw):
    from engine.core.engine_core import ProcessEngine

    defaults = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=512)
    return lambda: ProcessEngine(EngineConfig(model=str(model_dir), **{**defaults, **kw}))


# -- failure: a lost rank ends the server, never a hang ------------------------------------------------
def _augur_serve(model_dir, log_path, *extra: str, front: str = "on") -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--engine-process", front,
        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
        "--port", str(port), "-tp", "2", *extra,
    ]  # fmt: skip
    env = {**os.environ, "AUGUR_COMPILE": "off"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w")), port


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _workers(pid: int) -> list[int]:
    """The tensor-parallel workers under ``pid``: the processes forked by multiprocessing's fork server
    (which has a command line of its own, and they a copy of it)."""

    def forked(p: int) -> bool:
        try:
            with open(f"/proc/{p}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        return b"forkserver" in _cmdline(p) and b"forkserver" in _cmdline(parent)

    return [p for p in _descendants(pid) if forked(p)]


@contextlib.contextmanager
def _reaped(*procs: subprocess.Popen):
    """Kill whichever of ``procs`` is still running on the way out (a test that failed midway)."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _wait_answering(proc: subprocess.Popen, port: int, log) -> None:
    """Until the server ``proc`` started answers /health (it must not have exited: ``log`` says why)."""
    wait_until(lambda: _health(port) == 200 or proc.poll() is not None, "the server to answer", 180)
    assert proc.poll() is None, log.read_text()[-8000:]  # (each rank's traceback, before torchrun's summary)


def _health(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.parametrize("front", ["on", "off"], ids=["engine-process", "engine-thread"])
def test_a_killed_worker_ends_the_server_naming_its_rank(family_dirs, tmp_path, front):
    log = tmp_path / "log"
    proc, port = _augur_serve(family_dirs["LlamaForCausalLM"], log, front=front)
    with _reaped(proc):
        _wait_answering(proc, port, log)
        (worker,) = _workers(proc.pid)  # (rank 0 is the API process, or the engine process under it)
        os.kill(worker, signal.SIGKILL)
        code = proc.wait(timeout=30)
    assert code != 0
    assert "tensor-parallel worker rank 1 exited (exit code -9)" in log.read_text()


def test_ranks_that_do_not_join_in_time_are_a_clear_start_up_error(family_dirs, tmp_path):
    """Host 0 of two whose host 1 never starts: a start-up error after --tp-timeout, not a wait."""
    log = tmp_path / "log"
    hosts = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    proc, _ = _augur_serve(family_dirs["LlamaForCausalLM"], log, *hosts, "--tp-timeout", "1", front="off")
    with _reaped(proc):
        assert proc.wait(timeout=120) != 0
    assert "did not all join within 1 s" in log.read_text()


def test_a_collective_that_times_out_ends_the_server(family_dirs, tmp_path):
    """A worker that stops answering (SIGSTOP) makes the next forward's collective time out on rank 0
    after --tp-timeout: the server ends, non-zero, instead of hanging on the request. (10 s: at 3 s, a
    loaded host once kept rank 1 loading its shard past rank 0's first message, and the start failed.)"""
    log = tmp_path / "log"
    proc, port = _augur_serve(family_dirs["LlamaForCausalLM"], log, "--tp-timeout", "10", front="off")
    worker = None
    try:
        _wait_answering(proc, port, log)
        (worker,) = _workers(proc.pid)
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        os.kill(worker, signal.SIGSTOP)
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 8}
        with pytest.raises(httpx.HTTPError):  # the connection goes with the server
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        code = proc.wait(timeout=30)
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    assert "tensor-parallel execute failed on rank 0" in log.read_text()


# -- several hosts: here two `augur serve` processes on one machine, meeting at a master port ---------------


def test_two_hosts_serve_as_one_and_a_lost_host_ends_the_server(family_dirs, tmp_path, one_rank_answers):
    """Host 0 (``--node-rank 0``) serves HTTP with rank 0; host 1 runs rank 1 headless. The answers
    equal one rank's; killing host 1 ends host 0 (its next message or collective fails), non-zero."""
    d, want = family_dirs["LlamaForCausalLM"], one_rank_answers
    master = str(free_port())
    # (--tp-timeout bounds the join of two processes started apart on a loaded host, and a host's first
    # message to the other, loading its shard; a killed host ends the group at once)
    hosts = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master, "--tp-timeout", "60"]
    head, port = _augur_serve(d, tmp_path / "head", *hosts, "--node-rank", "0", "--served-model-name", "tiny")
    worker_host, _ = _augur_serve(d, tmp_path / "worker", *hosts, "--node-rank", "1")
    with _reaped(head, worker_host):
        _wait_answering(head, port, tmp_path / "head")
        assert _served_answers(type("Srv", (), {"base": f"http://127.0.0.1:{port}"})) == want
        assert "ranks 1..1 of 2, joining 127.0.0.1:" in (tmp_path / "worker").read_text()
        os.kill(worker_host.pid, signal.SIGKILL)
        code = head.wait(timeout=60)
    assert code != 0
    assert "tensor-parallel" in (tmp_path / "head").read_text()


def test_torchrun_starts_the_ranks_and_rank_0_serves(family_dirs, tmp_path, one_rank_answers):
    """torchrun's elastic agent starts one process a rank: each reads RANK, WORLD_SIZE and MASTER_* and
    the ranks meet in torchrun's store; rank 0 serves, rank 1 runs headless, and the answers equal one
    rank's. A rank killed makes torchrun end the group, non-zero."""
    port, log = free_port(), tmp_path / "log"
    # (--tp-timeout bounds the ranks' join, which may take more than a few seconds on a loaded host;
    # torchrun ends the group at once when a rank is killed)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "server.cli", "serve", "--model", str(family_dirs["LlamaForCausalLM"]),
        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4", "--port", str(port),
        "--served-model-name", "tiny", "--tp-timeout", "60",
    ]  # fmt: skip
    env = {**os.environ, "AUGUR_COMPILE": "off"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    with _reaped(proc):
        _wait_answering(proc, port, log)
        assert _served_answers(type("Srv", (), {"base": f"http://127.0.0.1:{port}"})) == one_rank_answers
        assert httpx.get(f"http://127.0.0.1:{port}/version").json()["tensor_parallel_size"] == 2
        (rank1,) = [p for p in _descendants(proc.pid) if b"\0RANK=1\0" in _environ(p) and b"server.cli" in _cmdline(p)]
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=60)
    assert code != 0
    assert "ranks 1..1 of 2, joining" in log.read_text()


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0" + f.read()
    except OSError:
        return b""
