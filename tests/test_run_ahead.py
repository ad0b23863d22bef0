"""Run-ahead decoding (``--async-scheduling``, engine/core/ahead.py): the next forward launched before
the last one's tokens are read, exact against ordinary steps, through aborts, failures and a server."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from test_eagle import write_eagle
from test_engine import make_engine, prompts, run_staggered
from test_spec import exact_joint, g_statistic, g_test_threshold, make, pair, sample_counts, small_vocab_pair, staggered  # noqa: F401
from test_spec import prompts as spec_prompts

from engine.config import EngineConfig
from engine.core.ahead import RunAhead
from engine.request.sampling_params import SamplingParams
from engine.runner.readback import Ticket
from server.app import ServerSettings, create_app
from servers import engine_factory, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def by_request(engine, ps, params) -> dict[str, list[int]]:
    return run_staggered(engine, ps, params, every=3)


def test_the_same_tokens_as_ordinary_steps_with_requests_coming_and_going(llama_dir):
    """Staggered arrivals drain the forward ahead and start it again; end of sequence, stop tokens,
    stop strings and max_tokens end sequences with a forward ahead of them in flight."""
    ps = prompts(7, seed=21, lo=4, hi=30)
    plain, ahead = make_engine(llama_dir, async_scheduling="off"), make_engine(llama_dir, async_scheduling="on")
    assert isinstance(ahead.ahead, RunAhead) and plain.ahead is None
    for params in (
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
    ):
        want = by_request(plain, ps, params)
        assert by_request(ahead, ps, params) == want
    free = plain.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[free.delta_token_ids[6]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, stop=[free.text[-6:-3]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True),
    ):
        want = [(c.delta_token_ids, c.finish_reason, c.text) for o in plain.generate(ps, params) for c in o.outputs]
        got = [(c.delta_token_ids, c.finish_reason, c.text) for o in ahead.generate(ps, params) for c in o.outputs]
        assert got == want
    assert ahead.ahead.num_launched > 20
    assert ahead.block_manager.num_free_blocks == ahead.block_manager.num_blocks
    # The context's end, five tokens past the longest prompt.
    short = dict(max_model_len=max(map(len, ps)) + 5)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = [
        c.delta_token_ids
        for o in make_engine(llama_dir, async_scheduling="off", **short).generate(ps, params)
        for c in o.outputs
    ]
    ahead = make_engine(llama_dir, async_scheduling="on", **short)
    assert [c.delta_token_ids for o in ahead.generate(ps, params) for c in o.outputs] == want
    assert ahead.ahead.num_launched > 0


def test_requests_it_cannot_run_ahead_drain_it(llama_dir):
    """A sampled, penalised or logprobs request beside greedy ones: ordinary steps, the same outputs."""
    ps = prompts(4, seed=22)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    others = [
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
    ]
    plain, ahead = make_engine(llama_dir, async_scheduling="off"), make_engine(llama_dir, async_scheduling="on")
    for other in others:
        params = [greedy, other, greedy, greedy]
        want = [(c.delta_token_ids, c.delta_logprobs) for o in plain.generate(ps, params) for c in o.outputs]
        got = [(c.delta_token_ids, c.delta_logprobs) for o in ahead.generate(ps, params) for c in o.outputs]
        assert got == want
    # Once the odd request (8 tokens) has finished, the greedy ones run ahead.
    assert ahead.ahead.num_launched > 0


def test_seeded_sampling_ahead_draws_the_same_tokens(llama_dir):
    """A seeded request's noise is that of (seed, output position): drawn a forward ahead, the same."""
    ps = prompts(6, seed=28, lo=4, hi=30)
    params = [
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=100 + i, max_tokens=18 + i, ignore_eos=True
        )
        for i in range(6)
    ]
    plain, ahead = make_engine(llama_dir, async_scheduling="off"), make_engine(llama_dir, async_scheduling="on")
    want = [c.delta_token_ids for o in plain.generate(ps, params) for c in o.outputs]
    assert [c.delta_token_ids for o in ahead.generate(ps, params) for c in o.outputs] == want
    assert ahead.ahead.num_launched > 10


def test_unseeded_sampling_ahead_keeps_the_targets_distribution(small_vocab_pair, monkeypatch):  # noqa: F811
    """Tokens 3-5 of 20,480 choices (token 3 drawn ahead of the host's token 2, 4 and 5 ahead of the
    device's) against the target's exact joint distribution of them; feeding each forward another
    row's token instead fails the same test."""
    target, _ = small_vocab_pair
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_tokens=5, ignore_eos=True)
    prompt, n = [0, 3, 4, 5], 20_480
    expected = exact_joint(target, prompt, params, skip=2)

    def samples() -> dict:
        eng = make(target, num_kv_blocks=4096, max_num_seqs=1024, block_size=8, async_scheduling="on")
        counts = sample_counts(eng, params, prompt, n, skip=2)
        assert eng.ahead.num_launched == 3 * n // 1024  # tokens 3, 4 and 5 of every wave of 1,024 choices
        return counts

    stat, dof = g_statistic(samples(), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    right = RunAhead.launch
    monkeypatch.setattr(
        RunAhead, "launch", lambda self, seqs, ids: right(self, seqs, None if ids is None else ids.roll(1))
    )
    stat, dof = g_statistic(samples(), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong inputs went unnoticed: G={stat:.1f} dof={dof}"


def test_a_full_house_runs_ahead_while_requests_wait_for_a_seat(llama_dir):
    ps = prompts(9, seed=29, lo=4, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = [
        c.delta_token_ids
        for o in make_engine(llama_dir, async_scheduling="off").generate(ps, params)
        for c in o.outputs
    ]
    ahead = make_engine(llama_dir, async_scheduling="on", max_num_seqs=4)
    assert [c.delta_token_ids for o in ahead.generate(ps, params) for c in o.outputs] == want
    assert ahead.ahead.num_launched >= 3 * 10  # three waves (4, 4, 1) of 12 tokens ahead at most


def test_a_pool_that_runs_short_drains_to_ordinary_steps_that_preempt(llama_dir, monkeypatch):
    """Two requests of 40 tokens in a pool of 64 slots: a forward ahead finds no slot, the step drains,
    an ordinary step preempts one; the same tokens."""
    ps = prompts(2, seed=30, lo=10, hi=11)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].delta_token_ids for o in make_engine(llama_dir, async_scheduling="off").generate(ps, params)]
    tight = make_engine(llama_dir, num_kv_blocks=16, enable_prefix_caching=False, async_scheduling="on")
    launch, short = tight.ahead.launch, []
    monkeypatch.setattr(tight.ahead, "launch", lambda *a: launch(*a) or short.append(1))
    assert [o.outputs[0].delta_token_ids for o in tight.generate(ps, params)] == want
    assert short and tight.scheduler.num_preemptions > 0 and tight.ahead.num_launched > 0
    assert tight.block_manager.num_free_blocks == 16


def test_an_arrival_with_a_seat_free_drains_and_one_still_to_serve_min_tokens_waits(llama_dir):
    engine = make_engine(llama_dir, async_scheduling="on")
    ps = prompts(2, seed=31)
    engine.add_request("a", ps[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.ahead.pending is not None
    engine.add_request("b", ps[1], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8))
    engine.step()  # drains: "b" may be admitted now
    assert engine.ahead.pending is None and engine.num_requests_waiting == 1
    engine.step()  # an ordinary step admits it
    assert engine.num_requests_running == 2
    b = next(s for s in engine.scheduler.running if s.group.request_id == "b")
    while b.num_output_tokens < 8:  # its end-of-sequence ban is a logits processor: ordinary steps only
        assert engine.ahead.pending is None
        engine.step()
    engine.step()
    assert engine.ahead.pending is not None


def test_each_forward_is_launched_before_the_last_ones_tokens_are_read(llama_dir, monkeypatch):
    engine = make_engine(llama_dir, async_scheduling="on")
    events: list[str] = []
    execute, tolist = engine.runner.execute, Ticket.tolist
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: events.append("launch") or execute(*a, **k))
    monkeypatch.setattr(Ticket, "tolist", lambda self: events.append("read") or tolist(self))
    engine.generate(prompts(3, seed=23), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # The prefill and a decode (ordinary steps: tokens 1 and 2), then the forward of token 3 from token 2
    # on the host, then each of tokens 4-12 launched before the token before it is read; the last read
    # drains.
    assert events == ["launch"] * 3 + ["launch", "read"] * 9 + ["read"]


def test_an_abort_with_a_forward_in_flight(llama_dir):
    ps = prompts(3, seed=24)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = {
        o.request_id: o.outputs[0].delta_token_ids
        for o in make_engine(llama_dir, async_scheduling="off").generate(ps[1:], params)
    }
    engine = make_engine(llama_dir, async_scheduling="on")
    for i, p in enumerate(ps):
        engine.add_request(f"a{i}", p, params)
    got = {f"a{i}": [] for i in range(3)}
    for _ in range(5):
        for o in engine.step():
            got[o.request_id] += o.outputs[0].delta_token_ids
    assert engine.ahead.pending is not None
    assert engine.abort("a0")
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.outputs[0].delta_token_ids
    assert [got["a1"], got["a2"]] == [want["gen-0-0"], want["gen-0-1"]]
    engine.step()  # what was still in flight for a0 is read and dropped
    assert engine.ahead.pending is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("error", [RuntimeError("device fault"), torch.OutOfMemoryError("out of memory")])
def test_a_forward_ahead_that_fails(llama_dir, monkeypatch, error):
    """A failed forward ahead fails its requests (an out-of-memory one preempts them: recomputed, same
    tokens); the engine serves on."""
    ps = prompts(2, seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].delta_token_ids for o in make_engine(llama_dir, async_scheduling="off").generate(ps, params)]
    engine = make_engine(llama_dir, async_scheduling="on")
    execute, calls = engine.runner.execute, []

    def failing(batch, input_ids=None, **kw):
        calls.append(input_ids is not None)
        if input_ids is not None and calls.count(True) == 3:
            raise error
        return execute(batch, input_ids=input_ids, **kw)

    monkeypatch.setattr(engine.runner, "execute", failing)
    outs = engine.generate(ps, params)
    if isinstance(error, torch.OutOfMemoryError):
        assert [o.outputs[0].delta_token_ids for o in outs] == want
        assert engine.scheduler.num_preemptions == 2
    else:
        assert [(o.error, o.outputs[0].finish_reason) for o in outs] == [("RuntimeError: device fault", "error")] * 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [o.outputs[0].delta_token_ids for o in engine.generate(ps, params)] == want
    assert calls.count(True) > 3


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_speculative_engine_runs_ahead_while_its_controller_drafts_nothing(pair, monkeypatch, temperature):  # noqa: F811
    """A draft-model engine whose controller is made to draft at full depth every fifth plan: the steps
    between run ahead, a plan that drafts drains the forward ahead and its step runs as an ordinary one
    on that plan. Every step is planned once: the roots of the plans asked are those of the target
    forwards' decode rows, one for one. The tokens are the plain decoder's."""
    ps = spec_prompts(10, seed=41)
    params = SamplingParams(temperature=temperature, seed=3 if temperature else None, max_tokens=30, ignore_eos=True)
    want = staggered(make(pair["target"], async_scheduling="off"), ps, params)
    eng = make(pair["target"], pair["noisy"], async_scheduling="on")
    assert eng.ahead is not None and eng.spec_method == "draft"
    plan, planned = eng.controller.plan, []

    def every_fifth(seqs, other_tokens, room):
        # Room to draft in: a token ahead on the device (all computed) takes a place too.
        assert room == [max(s.tokens_left(eng.max_model_len) - 1 - (s.num_uncomputed_tokens == 0), 0) for s in seqs]
        depths = plan(seqs, other_tokens, room)
        planned.extend((s.seq_id, s.num_computed_tokens) for s in seqs)  # (a decode's root: its first uncomputed)
        return [min(eng.controller.max_depth, r) for r in room] if len(planned) % 5 == 0 else [0] * len(depths)

    monkeypatch.setattr(eng.controller, "plan", every_fifth)
    prepare, decoded = eng.runner.prepare, []

    def decode_rows(chunks, *a, **k):
        running = {id(s.block_table): s for s in eng.scheduler.running}
        for c in chunks:
            seq = running[id(c.block_table)]
            if c.ctx_len >= seq.num_prompt_tokens:  # (no preemption here: nothing else starts past the prompt)
                decoded.append((seq.seq_id, c.ctx_len))
        return prepare(chunks, *a, **k)

    monkeypatch.setattr(eng.runner, "prepare", decode_rows)
    assert staggered(eng, ps, params) == want
    assert sorted(planned) == sorted(decoded)
    assert eng.ahead.num_launched > 20 and eng.spec_stats.num_drafts > 5
    assert eng.scheduler.num_preemptions == 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_step_the_kv_pool_cannot_launch_ahead_is_not_planned_again(pair, monkeypatch):  # noqa: F811
    """A pool too small for every sequence's next slot: the launch ahead fails after its step was planned,
    and the ordinary step that follows runs on that plan. A sequence is planned twice at one root only
    if it was preempted in between (recomputed, it decodes from that root again)."""
    ps = spec_prompts(8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = staggered(make(pair["target"], async_scheduling="off", num_kv_blocks=40), ps, params)
    eng = make(pair["target"], pair["noisy"], async_scheduling="on", num_kv_blocks=40)
    plan, events, short = eng.controller.plan, [], []

    def never(seqs, other_tokens, room):
        events.extend(("plan", s.seq_id, s.num_computed_tokens) for s in seqs)
        return [0] * len(plan(seqs, other_tokens, room))

    launch, preempt = eng.ahead.launch, eng.scheduler.preempt
    monkeypatch.setattr(eng.controller, "plan", never)
    monkeypatch.setattr(eng.ahead, "launch", lambda seqs, ids: launch(seqs, ids) or short.append(1))
    monkeypatch.setattr(eng.scheduler, "preempt", lambda seq: events.append(("preempt", seq.seq_id, 0)) or preempt(seq))
    assert staggered(eng, ps, params) == want
    assert short and eng.ahead.num_launched > 10
    seen: set[tuple[int, int]] = set()
    for what, sid, root in events:
        if what == "preempt":
            seen = {k for k in seen if k[0] != sid}
        else:
            assert (sid, root) not in seen, f"sequence {sid} planned twice at root {root}"
            seen.add((sid, root))


def test_steps_ahead_feed_the_guards_plain_rate(pair, monkeypatch):  # noqa: F811
    """The guard holds drafting to plain decoding as it runs: steps ahead are plain steps to it, beside
    the ordinary ones."""
    eng = make(pair["target"], pair["noisy"], async_scheduling="on")
    eng.controller.guard.buckets.clear()
    observe_step, ordinary = eng.controller.observe_step, []

    def counted(num_seqs, tokens, seconds, forward_seconds, num_drafting, batch):
        ordinary.append(batch.decode_only and not num_drafting)
        observe_step(num_seqs, tokens, seconds, forward_seconds, num_drafting, batch)

    launch, ahead = eng.ahead.launch, []  # forwards launched from a pending one's tokens: steps ahead

    def launched(seqs, input_ids):
        pending = launch(seqs, input_ids)
        ahead.append(pending is not None and input_ids is not None)
        return pending

    monkeypatch.setattr(eng.controller, "observe_step", counted)
    monkeypatch.setattr(eng.ahead, "launch", launched)
    eng.generate(spec_prompts(1, seed=42), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    (bucket,) = eng.controller.guard.buckets.values()
    assert sum(ahead) > 5 and len(bucket.plain) < bucket.plain.maxlen
    assert len(bucket.plain) == sum(ordinary) + sum(ahead)


def test_engines_it_does_not_apply_to_run_ordinary_steps(llama_dir, tmp_path):
    """A proposer that reads the target's features of every token (an EAGLE head) misses those of forwards ahead."""
    head = write_eagle(llama_dir, tmp_path / "head")
    engine = make_engine(llama_dir, async_scheduling="on", speculative_method="eagle", draft_model=str(head))
    assert engine.spec_method == "eagle" and engine.ahead is None
    assert make_engine(llama_dir, async_scheduling="on", speculative_method="ngram").ahead is not None


def test_the_setting(monkeypatch):
    """auto: on for CPUs (measured there), off on GPUs until measured; a YAML bool reads as on/off."""
    assert EngineConfig(model="m", device="cpu").async_scheduling_enabled
    assert not EngineConfig(model="m", device="cpu", async_scheduling=False).async_scheduling_enabled
    assert EngineConfig(model="m", device="cpu", async_scheduling=True).async_scheduling == "on"
    with pytest.raises(ValueError, match="async_scheduling must be auto, on or off"):
        EngineConfig(model="m", async_scheduling="sometimes")
    # A GPU's engine (its device as a CUDA host resolves it; the setting reads nothing else of it).
    monkeypatch.setattr(EngineConfig, "torch_device", property(lambda self: torch.device("cuda")))
    assert not EngineConfig(model="m", device="cuda").async_scheduling_enabled
    assert EngineConfig(model="m", device="cuda", async_scheduling=True).async_scheduling_enabled


@pytest.mark.gpu
def test_run_ahead_through_graphs_on_gpu(llama_dir):
    """On CUDA, as served there (graphs, triton attention), with two tokens' readbacks in flight at once."""
    ps = prompts(6, seed=27, lo=4, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = by_request(make_engine(llama_dir, device="cuda", async_scheduling="off"), ps, params)
    engine = make_engine(llama_dir, device="cuda", async_scheduling="on")
    assert engine.runner.graphs is not None
    assert by_request(engine, ps, params) == want
    assert engine.ahead.num_launched > 20


@pytest.mark.parametrize("front", ["thread", "process"])
def test_served_with_async_scheduling(llama_dir, monkeypatch, front):
    """The OpenAI SDK, streaming and not, eight requests at once: the tokens of ordinary steps."""
    if front == "process":
        monkeypatch.setenv("AUGUR_TEST_FRONT", "process")
    ps = prompts(8, seed=26, lo=4, hi=20)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    want = [
        o.outputs[0].text
        for o in make_engine(llama_dir, async_scheduling="off", max_model_len=512).generate(ps, params)
    ]
    app = create_app(ServerSettings(served_model_name="tiny"), engine_factory(llama_dir, async_scheduling="on"))
    with serve(app) as s:
        client = openai.AsyncOpenAI(base_url=s.base + "/v1", api_key="x")

        async def one(i: int) -> str:
            kw = dict(model="tiny", prompt=ps[i], max_tokens=20, temperature=0.0)
            if i % 2:
                return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kw)])
            return (await client.completions.create(**kw)).choices[0].text

        async def all_of_them():
            try:
                return await asyncio.gather(*(one(i) for i in range(len(ps))))
            finally:
                await client.close()

        assert asyncio.run(all_of_them()) == want
