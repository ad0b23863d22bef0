"""More choices than a step seats (``n`` up to 128, ``--max-num-seqs`` small): the choices beyond the
seats are forked all the same, sharing the prompt's KV, and wait for a seat; they run as seats free,
round-robin with other requests, and each choice's seeded output is the one it gets when all run at
once. Beams still must fit one batch. Through the scheduler alone, an engine, and a real server with
the official openai SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import Scheduler
from engine.kv import BlockManager
from engine.request.checks import InvalidRequestError, check_request
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence, SequenceGroup, SequenceStatus
from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve, wait_until

MODEL = "tiny-llama"
SEATS = 8  # --max-num-seqs of every engine here but the wide reference
N = 100
PROMPT = [11, 12, 13, 14, 11, 12]
SEEDED = dict(n=N, temperature=1.0, seed=1234, max_tokens=5, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("many-choices") / "m", tokenizer_dir, "LlamaForCausalLM")


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, block_size=4)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def choices(eng: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[list[int]]]:
    outs = eng.generate([p for p, _ in requests], [sp for _, sp in requests])
    return [[c.delta_token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def idle(eng: LLMEngine) -> bool:
    return not eng.has_unfinished_requests() and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# -- the scheduler alone -------------------------------------------------------------------------------------
def first_seq(prompt_len: int, n: int, base: int) -> Sequence:
    return SequenceGroup(f"req-{base}", list(range(base, base + prompt_len)), SamplingParams(n=n), 0.0).seqs[0]


def fork_all(sched: Scheduler, parent: Sequence) -> list[Sequence]:
    """The engine's fork after the prompt: every other choice shares the parent's blocks and has its
    first token."""
    children = []
    for i in range(1, parent.params.n):
        child = Sequence(parent.group, parent.prompt_ids, index=i)
        child.block_table = sched.bm.fork(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        parent.group.seqs.append(child)
        sched.add_forked(child, parent)
        children.append(child)
    for s in [parent, *children]:
        s.token_ids.append(7)
    return children


def test_choices_beyond_the_seats_wait_with_their_kv_and_take_turns() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    parent = first_seq(6, n=10, base=100)
    sched.add(parent)
    out = sched.schedule()  # an idle engine seats it with 4 seats held, not 10: no hang
    assert [(s, n) for s, n in out.scheduled] == [(parent, 6)]
    parent.num_computed_tokens = 6
    late = first_seq(3, n=1, base=200)
    sched.add(late)  # queued while the prompt runs: no seat for it
    children = fork_all(sched, parent)
    assert sched.running == [parent, *children[:3]]
    waiting = children[3:]
    assert list(sched.waiting) == [late, *waiting] and all(c.awaits_seat for c in waiting)
    assert all(bm.ref_count(b) == 10 for b in parent.block_table)  # shared, nothing recomputed

    sched.finish(children[0])  # a seat frees: the request queued first takes it
    out = sched.schedule()
    assert [s for s, _ in out.scheduled][-1] is late
    sched.finish(children[1])
    out = sched.schedule()
    assert out.scheduled[-1] == (waiting[0], 1)  # a decode at once: its prompt is not recomputed
    another = first_seq(3, n=1, base=300)
    sched.add(another)
    sched.finish(children[2])
    sched.finish(late)
    out = sched.schedule()  # two seats: one waiting choice, then the newcomer ahead of its mates
    assert [s for s, _ in out.scheduled][-2:] == [waiting[1], another]
    assert list(sched.waiting) == waiting[2:]
    for s in list(sched.running):
        sched.finish(s)
    for s in list(sched.waiting):
        sched.finish(s)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_waiting_choices_give_up_their_kv_to_an_idle_engine() -> None:
    """Nothing runs and the head of the queue does not fit beside the KV that waiting choices hold:
    they give it up (recomputed later) rather than everyone waiting forever."""
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    parent = first_seq(15, n=4, base=100)  # 4 blocks of 6
    sched.add(parent)
    sched.schedule()
    parent.num_computed_tokens = 15
    big = first_seq(16, n=1, base=200)  # needs 4 blocks
    sched.add(big)
    children = fork_all(sched, parent)
    waiting = [c for c in children if c.status is SequenceStatus.WAITING]
    assert [c.index for c in waiting] == [2, 3]
    sched.finish(parent)
    sched.finish(children[0])
    assert sched.running == [] and bm.num_free_blocks == 2  # the waiting choices hold the prompt

    out = sched.schedule()

    assert out.scheduled == [(big, 16)] and out.preempted == waiting[::-1]
    assert not any(c.block_table or c.awaits_seat for c in waiting)
    sched.finish(big)
    out = sched.schedule()  # they come back by recomputing their tokens
    assert out.scheduled == [(waiting[0], 16)]
    bm.check_invariants()


def test_sampling_choices_pass_the_checks_and_beams_do_not() -> None:
    check = lambda params: check_request(PROMPT, params, 384, 64, SEATS, 64, 1024, False)  # noqa: E731
    check(SamplingParams(n=128))
    check(SamplingParams(n=2, best_of=SEATS, use_beam_search=True))
    for params, param in [
        (SamplingParams(n=2, best_of=SEATS + 1, use_beam_search=True), "best_of"),
        (SamplingParams(n=SEATS + 1, use_beam_search=True), "n"),
    ]:
        with pytest.raises(InvalidRequestError, match=r"beams exceed the 8 sequences") as e:
            check(params)
        assert e.value.param == param


# -- an engine -------------------------------------------------------------------------------------------------
def test_waiting_choices_sample_what_they_would_at_once(llama_dir) -> None:
    """Choice i draws from seed + i wherever it waits: the same tokens beside other requests, all at
    once (128 seats), through 8 seats, through 8 seats on a pool so small that they are preempted,
    running ahead, and drafting."""
    others = [([20 + i, 30, 40 + i], SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i)) for i in range(3)]
    requests = [(PROMPT, SamplingParams(**SEEDED)), *others]
    wide = choices(make_engine(llama_dir, max_num_seqs=128), requests)
    assert len(wide[0]) == N and len({tuple(c) for c in wide[0]}) > 1
    tight = dict(num_kv_blocks=14, max_model_len=56)
    drafting = dict(draft_model=str(llama_dir), num_speculative_tokens=3)
    for kw in (dict(), tight, dict(async_scheduling="on"), drafting):
        eng = make_engine(llama_dir, max_num_seqs=SEATS, **kw)
        assert choices(eng, requests) == wide, kw
        assert idle(eng)
        eng.block_manager.check_invariants()
        assert (eng.scheduler.num_preemptions > 0) == (kw is tight)
        if eng.ahead is not None:
            assert eng.ahead.num_launched > 0
    assert eng.spec_stats.num_draft_tokens > 0


def test_a_later_request_is_not_starved(llama_dir) -> None:
    eng = make_engine(llama_dir, max_num_seqs=SEATS)
    eng.add_request("big", PROMPT, SamplingParams(**{**SEEDED, "max_tokens": 8}))
    while len(eng.groups["big"].seqs) < N:
        eng.step()
    eng.add_request("small", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    done: set[str] = set()
    while "small" not in done:
        done |= {o.request_id for o in eng.step() if o.finished}
    # The small request took a seat as soon as the first ones freed, ahead of the big one's waiting choices.
    assert "big" not in done
    assert sum(s.is_finished for s in eng.groups["big"].seqs) <= 2 * SEATS
    assert any(s.awaits_seat for s in eng.groups["big"].seqs)
    assert eng.abort("big")  # its waiting choices' KV is freed with the rest
    assert idle(eng)
    eng.block_manager.check_invariants()


# -- a real server -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(llama_dir) -> Iterator[Served]:
    settings = ServerSettings(served_model_name=MODEL, max_queue_len=2)  # a request of 100 choices is one
    with serve(create_app(settings, engine_factory(llama_dir, max_num_seqs=SEATS))) as s:
        yield s


CHAT = [{"role": "user", "content": "Say something."}]
SDK_SEEDED = dict(n=N, temperature=1.0, seed=1234, max_tokens=5, extra_body={"ignore_eos": True})


def check_choices(got, text) -> list[str]:
    assert sorted(c.index for c in got) == list(range(N))
    assert all(c.finish_reason == "length" for c in got)
    return [text(c) for c in sorted(got, key=lambda c: c.index)]


def streamed(stream, text) -> tuple[list[str], dict[int, str], object]:
    """(each index's text, each index's finish reason, the usage) assembled from the chunks."""
    texts, reasons, usage = [""] * N, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += text(c) or ""
            if c.finish_reason is not None:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_100_streamed_and_not(srv, client, endpoint) -> None:
    if endpoint == "completions":
        create = lambda **kw: client.completions.create(model=MODEL, prompt="Once upon", **SDK_SEEDED, **kw)  # noqa: E731
        text, delta = (lambda c: c.text), (lambda c: c.text)
    else:
        create = lambda **kw: client.chat.completions.create(model=MODEL, messages=CHAT, **SDK_SEEDED, **kw)  # noqa: E731
        text, delta = (lambda c: c.message.content), (lambda c: c.delta.content)
    whole = create()
    texts = check_choices(whole.choices, text)
    assert len(set(texts)) > 1  # choice i draws from seed + i
    assert whole.usage.completion_tokens == N * 5
    assert create().choices == whole.choices  # the same seed, the same 100 choices

    parts, reasons, usage = streamed(create(stream=True, stream_options={"include_usage": True}), delta)
    assert parts == texts
    assert reasons == dict.fromkeys(range(N), "length")
    assert usage.completion_tokens == N * 5
    wait_until(lambda: idle(srv.engine), "the engine to be idle")


def test_a_concurrent_request_completes_while_the_big_one_runs(srv, client) -> None:
    first, reasons = threading.Event(), {}

    def big() -> None:
        stream = client.completions.create(model=MODEL, prompt="Once upon", stream=True, **SDK_SEEDED)
        for chunk in stream:
            first.set()
            reasons.update((c.index, c.finish_reason) for c in chunk.choices if c.finish_reason)

    thread = threading.Thread(target=big)
    thread.start()
    try:
        assert first.wait(120), "the big request never started"
        small = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert small.choices[0].finish_reason in ("length", "stop")
        # (A lagging reader only sees fewer: the bound holds whatever the timing.)
        assert len(reasons) < N // 2, "the small request waited behind the big one's waiting choices"
    finally:
        thread.join(120)
    assert set(reasons) == set(range(N))


def test_limits_are_400s_naming_the_field(srv, client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=129, max_tokens=2)
    assert e.value.body["param"] == "n" and "128" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=129, max_tokens=2)
    assert e.value.body["param"] == "n"
    beams = {"use_beam_search": True, "best_of": SEATS + 1}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=2, extra_body=beams)
    assert e.value.body["param"] == "best_of" and "--max-num-seqs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="hi", n=SEATS + 1, max_tokens=2, extra_body={"use_beam_search": True}
        )
    assert e.value.body["param"] == "n"
    both = client.completions.create(model=MODEL, prompt="hi", n=128, max_tokens=1, extra_body={"best_of": 128})
    assert sorted(c.index for c in both.choices) == list(range(128))
    wait_until(lambda: idle(srv.engine), "the engine to be idle")
