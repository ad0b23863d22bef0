"""One request's trouble stays its own (issue 66).

* Per-request host work (strategies, grammar advance, logprobs, stop checks, detokenizing) that raises
  fails that request alone, with its own error; the rest of its step commits, and the others' outputs
  equal their outputs alone.
* Arithmetic on user-set exponents cannot overflow, and every numeric field, at its extremes, is served
  as its limit or refused with a 400 naming it, never a 500, while an ordinary request beside them is
  unchanged.
* A fair step: a wide request (a long prompt, contrastive search's candidates) takes its share of a
  step and what the others leave, so they are seated in the same step; contrastive search split over
  steps chooses what it would all at once. (Timing is never asserted: docs/benchmarks.md has figures.)
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading

import httpx
import pytest
import torch
import transformers
from test_contrastive_search import GREEDY as SEARCH_GREEDY
from test_contrastive_search import PROMPTS as SEARCH_PROMPTS
from test_contrastive_search import reference, search
from test_engine import make_engine
from test_scheduler import advance, make_seq, plan

from conftest import build_model_dir
from engine.core.llm_engine import LLMEngine
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.decoding.beam import BeamSearch, length_normed
from engine.decoding.contrastive_search import ContrastiveSearch
from engine.kv import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import SequenceGroup
from engine.request.state import SearchState
from engine.request.structured import StructuredOutput
from engine.sampling.constrain import Constraints
from engine.sampling.logprobs import LogprobRows
from server.app import ServerSettings, create_app
from servers import NUM_BLOCKS, engine_factory, serve, wait_until

MODEL = "tiny-llama"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def srv(llama_dir):
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(llama_dir))) as s:
        yield s


def tokens(outs) -> list[list[list[int]]]:
    return [[c.delta_token_ids for c in o.outputs] for o in outs]


def assert_idle(engine: LLMEngine) -> None:
    sched, bm = engine.scheduler, engine.block_manager
    assert not engine.groups and not sched.running and not sched.waiting
    assert bm.num_free_blocks == bm.num_blocks


# -- 1. per-request host work fails per request --------------------------------------------------------
MARKER = 7  # a token id only the doomed request's prompt holds
MIX = {  # one request of each kind that has per-request host work in the step
    "greedy": ([40, 50, 60, 70], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
    "sampled": ([41, 51, 61], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)),
    "choices": ([42, 52, 62], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)),
    "beams": ([43, 53, 63], SamplingParams(use_beam_search=True, best_of=2, max_tokens=6, ignore_eos=True)),
    "search": ([44, 54, 64], SamplingParams(penalty_alpha=0.6, top_k=4, max_tokens=6, ignore_eos=True)),
    "grammar": (
        [45, 55, 65],
        SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput("regex", "[a-z]{3,6}")),
    ),
    "stop": ([46, 56, 66], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["e", "t"])),
    "echo": ([47, 57, 67], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)),
}
TOP_MARK = 3  # the doomed logprobs requests ask for 3 alternatives, the others for 2: LogprobRows.of tells them by it


def _doomed_by_prompt(arg) -> bool:
    return MARKER in arg.prompt_ids


# stage: (the doomed request's kind, changes to its params, the class, the method, its request from the call's args)
STAGES = {
    "beam step": ("beams", {}, BeamSearch, "_step", lambda a: a[1]),
    "contrastive pick": ("search", {}, ContrastiveSearch, "_score", lambda a: a[0].seq),
    "contrastive record": ("search", {}, ContrastiveSearch, "record", lambda a: a[1]),
    "fork": ("choices", {}, LLMEngine, "_fork_one", lambda a: a[1]),
    "grammar advance": ("grammar", {}, Constraints, "advance", lambda a: a[1].seq),
    "logprobs": ("sampled", {"logprobs": TOP_MARK}, LogprobRows, "of", None),
    "prompt logprobs": ("echo", {"prompt_logprobs": TOP_MARK}, LogprobRows, "of", None),
    "stop checks": ("stop", {}, OutputProcessor, "append", lambda a: a[1]),
    "detokenizing": ("greedy", {}, OutputProcessor, "make_output", lambda a: a[1]),
}


@pytest.fixture(scope="module")
def mix_engine(llama_dir) -> LLMEngine:
    return make_engine(llama_dir, num_kv_blocks=256)


@pytest.fixture(scope="module")
def alone(mix_engine) -> dict[str, list[list[int]]]:
    return {kind: tokens(mix_engine.generate([p], params))[0] for kind, (p, params) in MIX.items()}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_in_one_requests_own_work_fails_it_alone(stage, mix_engine, alone, monkeypatch):
    """An exception injected into one stage of the step's per-request host work, for one request of a
    mixed batch, fails that request with its own error; every other request, of every kind, ends as it
    does alone; no block or sequence of the failed one is left behind."""
    kind, changes, cls, name, request_of = STAGES[stage]
    original = cls.__dict__[name]
    call = original.__func__ if isinstance(original, staticmethod) else original

    def faulty(*args):
        if request_of is None:  # LogprobRows.of(self, i): the doomed request is the one asking for TOP_MARK
            doomed = args[0].requests[args[1]][2] == TOP_MARK
        else:
            doomed = _doomed_by_prompt(request_of(args))
        if doomed:
            raise RuntimeError(f"injected into {stage}")
        return call(*args)

    monkeypatch.setattr(cls, name, staticmethod(faulty) if isinstance(original, staticmethod) else faulty)
    prompt, params = MIX[kind]
    kinds = list(MIX)
    prompts = [MIX[k][0] for k in kinds] + [[MARKER, *prompt]]
    outs = mix_engine.generate(prompts, [MIX[k][1] for k in kinds] + [dataclasses.replace(params, **changes)])
    *others, doomed = outs
    assert doomed.error is not None and f"RuntimeError: injected into {stage}" in doomed.error
    assert all(c.finish_reason == "error" for c in doomed.outputs)
    assert [o.error for o in others] == [None] * len(kinds)
    assert dict(zip(kinds, tokens(others))) == alone
    assert_idle(mix_engine)


# -- 2. scores that cannot overflow ------------------------------------------------------------------------
def test_beam_scores_never_overflow():
    """``score / length ** penalty`` where the power leaves the floats saturates instead of raising, and is
    exactly the plain quotient wherever the power is a float."""
    assert length_normed(-5.0, 1300, 100.0) == pytest.approx(-5.0 * 1300.0**-100, rel=1e-9)
    assert length_normed(-5.0, 10**6, 100.0) == 0.0  # 10^600: the quotient is below every float
    assert length_normed(-5.0, 2000, -100.0) == float("-inf")  # 2000^-100 is 0: beyond every float
    assert length_normed(0.0, 2000, -100.0) == 0.0
    for length in (1, 2, 7, 100, 511):
        for penalty in (-100.0, -2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, 100.0):
            assert length_normed(-3.7, length, penalty) == -3.7 / length**penalty


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with a context long enough for the issue's 1300-token beams."""
    return build_model_dir(
        tmp_path_factory.mktemp("long"), tokenizer_dir, "LlamaForCausalLM", max_position_embeddings=2048
    )


def test_the_issues_beam_search_serves_and_its_neighbour_is_untouched(long_dir, tokenizer_dir):
    """The issue's request: 1300 tokens of beams, ``length_penalty`` 100 with ``early_stopping: "never"``
    (1300 ** 100 overflowed in the improvability check: a 500 for it and for the greedy request in its
    step). It now runs to its end, and the greedy request beside it gets its text alone."""
    engine = make_engine(long_dir, num_kv_blocks=1024, max_model_len=2048)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = tok.encode("def fibonacci(n):\n")
    beams = SamplingParams(use_beam_search=True, best_of=2, max_tokens=1300, stop=["\n"], early_stopping="never",
                           length_penalty=100.0)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    neighbour = [50, 60, 70]
    alone = tokens(engine.generate([neighbour], greedy))
    beam, beside = engine.generate([prompt, neighbour], [beams, greedy])
    assert beam.error is None and beside.error is None
    assert beam.outputs[0].finish_reason in ("stop", "length")
    assert tokens([beside]) == alone
    assert_idle(engine)


# -- every numeric field at its extremes ------------------------------------------------------------------
EXTREMES = [1e308, -1e308, 10**30, -(10**30), -0.0, 0, -1]

CMPL = {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 3}
BEAM = {"use_beam_search": True, "best_of": 2, "n": 1}
SEARCH = {"penalty_alpha": 0.6, "top_k": 4}

# (field as the error names it, the body with the value put in, the context it applies in)
FIELDS = {
    "temperature": lambda v: {"temperature": v},
    "top_p": lambda v: {"top_p": v, "temperature": 1.0},
    "top_k": lambda v: {"top_k": v, "temperature": 1.0},
    "min_p": lambda v: {"min_p": v, "temperature": 1.0},
    "presence_penalty": lambda v: {"presence_penalty": v},
    "frequency_penalty": lambda v: {"frequency_penalty": v},
    "repetition_penalty": lambda v: {"repetition_penalty": v},
    "logit_bias": lambda v: {"logit_bias": {"5": v}},
    "max_tokens": lambda v: {"max_tokens": v},
    "min_tokens": lambda v: {"min_tokens": v},
    "n": lambda v: {"n": v},
    "best_of": lambda v: {**BEAM, "best_of": v},
    "length_penalty": lambda v: {**BEAM, "length_penalty": v, "early_stopping": "never"},
    "seed": lambda v: {"seed": v, "temperature": 1.0},
    "penalty_alpha": lambda v: {**SEARCH, "penalty_alpha": v},
    "top_k (search)": lambda v: {**SEARCH, "top_k": v},
    "contrastive": lambda v: {"contrastive": {"alpha": v, "beta": v}},
    "no_repeat_ngram_size": lambda v: {"no_repeat_ngram_size": v},
    "speculative": lambda v: {"speculative": {"num_draft_tokens": v}},
    "speculative ": lambda v: {"temperature": 1.0, "speculative": {"typical_acceptance": {"epsilon": v, "delta": v}}},
}
CMPL_ONLY = {"logprobs": lambda v: {"logprobs": v}, "max_tokens (echo)": lambda v: {"max_tokens": v, "echo": True}}
CHAT_ONLY = {
    # (the engine knows it by its older name: a 400 may name either)
    "max_completion_tokens|max_tokens": lambda v: {"max_completion_tokens": v, "max_tokens": None},
    "top_logprobs": lambda v: {"logprobs": True, "top_logprobs": v},
    "thinking_token_budget": lambda v: {"thinking_token_budget": v},
}


def _battery() -> list[tuple[list[str], str, dict]]:
    cases = []
    for path, base, only in (("/v1/completions", CMPL, CMPL_ONLY), ("/v1/chat/completions", CHAT, CHAT_ONLY)):
        for field, body in {**FIELDS, **only}.items():
            for v in EXTREMES:
                cases.append((field.split()[0].split("|"), path, {**base, **body(v)}))
    return cases


def test_every_numeric_field_at_its_extremes_is_served_or_refused_by_name(srv):
    """1e308, 10^30, negative zero and huge negatives in every numeric field of both endpoints: a 200 (the
    value served as its limit) or a 400 naming the field, never a 500; a greedy request running beside
    them all the while gets its text alone."""
    canary = {**CMPL, "prompt": "The canary sings", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=srv.base, timeout=120) as c:
        alone = c.post("/v1/completions", json=canary).json()["choices"][0]["text"]
    cases, failures, beside = _battery(), [], {}

    def run_canary():
        with httpx.Client(base_url=srv.base, timeout=120) as c:
            while not beside.get("stop"):
                beside.setdefault("texts", []).append(c.post("/v1/completions", json=canary).json())

    t = threading.Thread(target=run_canary)
    t.start()

    async def run():
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as c:
            sem = asyncio.Semaphore(8)

            async def one(path, body):
                async with sem:
                    return await c.post(path, json=body)

            return await asyncio.gather(*(one(path, body) for _, path, body in cases))

    try:
        answers = asyncio.run(run())
    finally:
        beside["stop"] = True
        t.join(timeout=120)
    for (field, path, body), r in zip(cases, answers):
        if r.status_code == 200:
            continue
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        named = any(name in (err.get("param") or "") or name in (err.get("message") or "") for name in field)
        if r.status_code != 400 or not named:
            failures.append(f"{path} {field}={body}: {r.status_code} {r.text[:300]}")
    assert not failures, f"{len(failures)} of {len(cases)}:\n" + "\n".join(failures)
    assert beside["texts"] and all(o["choices"][0]["text"] == alone for o in beside["texts"])
    eng = srv.engine
    wait_until(lambda: not eng.has_unfinished_requests(), "the engine to go idle")
    assert eng.block_manager.num_free_blocks == NUM_BLOCKS


# -- 3. a fair step --------------------------------------------------------------------------------------
def test_a_long_prompt_takes_what_the_others_leave_and_they_are_seated_beside_it():
    """Alone, a long prompt's chunk is the whole budget; a request arriving while it is prefilled is
    seated in the next step, with its whole prompt, and the long one takes the rest."""
    sched = Scheduler(BlockManager(400, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    long = make_seq(1000)
    sched.add(long)
    out = sched.schedule()
    assert plan(out) == [(long.seq_id, 64)]
    advance(sched, out)
    short = make_seq(20)
    sched.add(short)
    out = sched.schedule()
    assert plan(out) == [(long.seq_id, 44), (short.seq_id, 20)]
    advance(sched, out)
    out = sched.schedule()  # the short one decodes beside the long one's next chunk
    assert plan(out) == [(long.seq_id, 63), (short.seq_id, 1)]


def test_two_wide_requests_share_the_step():
    """Two long prompts: each gets its share; what one cannot use (its prompt ends) goes to the other."""
    sched = Scheduler(BlockManager(400, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(500), make_seq(40)
    sched.add(a)
    sched.add(b)
    assert plan(sched.schedule()) == [(a.seq_id, 32), (b.seq_id, 32)]  # the two shares, nothing left
    c = make_seq(500)
    sched2 = Scheduler(BlockManager(400, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    d = make_seq(10)
    sched2.add(c)
    sched2.add(d)
    assert plan(sched2.schedule()) == [(c.seq_id, 54), (d.seq_id, 10)]


def test_contrastive_candidates_are_split_so_a_waiting_request_is_seated():
    """A search whose top_k is the whole budget feeds all its candidates at once alone; beside a waiting
    request it takes what that one leaves, and its other candidates go in the next step, in the slots after
    the ones fed, beside the other's decode."""
    sched = Scheduler(BlockManager(200, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    seq = SequenceGroup("search", list(range(10, 20)), SamplingParams(penalty_alpha=0.6, top_k=64), 0.0).seqs[0]
    seq.search = SearchState()
    sched.add(seq)
    assert plan(sched.schedule()) == [(seq.seq_id, 10)]
    seq.num_computed_tokens = 10
    seq.search.start_token(next_logits=object())  # the prefill's last row: its first token's logits
    assert plan(copy.deepcopy(sched).schedule()) == [(seq.seq_id, 64)]

    waiting = make_seq(6)
    sched.add(waiting)
    out = sched.schedule()
    assert plan(out) == [(seq.seq_id, 58), (waiting.seq_id, 6)]
    assert len(seq.block_table) * 4 >= 10 + 58
    seq.search.fed = 58  # (what the step does with them)
    advance(sched, SchedulerOutput(scheduled=[(waiting, 6)]))
    out = sched.schedule()
    assert plan(out) == [(seq.seq_id, 6), (waiting.seq_id, 1)]
    assert len(seq.block_table) * 4 >= 10 + 64
    sched.bm.check_invariants()


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory, tokenizer_dir):
    # test_contrastive_search's model: sharper weights, so the penalty matters.
    return build_model_dir(tmp_path_factory.mktemp("cs-split"), tokenizer_dir, "LlamaForCausalLM", std=0.3)


def test_contrastive_search_split_over_steps_chooses_as_all_at_once(search_dir, monkeypatch):
    """With a budget of 12 and greedy requests beside them, searches of top_k 6 and 12 are fed in parts
    (checked); each still picks the tokens of the reference that scores all candidates at once, and the
    greedy requests get their tokens alone."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(search_dir, dtype=torch.float32).eval()
    engine = make_engine(search_dir, max_num_batched_tokens=12)
    greedy = tokens(engine.generate(SEARCH_PROMPTS, SEARCH_GREEDY))
    parts = []
    chunk = ContrastiveSearch.chunk
    monkeypatch.setattr(
        ContrastiveSearch, "chunk", staticmethod(lambda seq, n: parts.append(n < seq.params.top_k) or chunk(seq, n))
    )
    for alpha, k in [(0.6, 6), (0.5, 12)]:
        outs = engine.generate(SEARCH_PROMPTS + SEARCH_PROMPTS, [search(alpha, k)] * 3 + [SEARCH_GREEDY] * 3)
        got = tokens(outs)
        assert [g[0] for g in got[:3]] == [reference(hf, p, alpha, k) for p in SEARCH_PROMPTS], (alpha, k)
        assert got[3:] == greedy
    assert any(parts), "no search was split"
    assert_idle(engine)


def test_a_request_arriving_beside_a_wide_search_is_seated_in_the_next_step(search_dir):
    """A search whose top_k is the step's whole budget is running; a greedy request with a short prompt added
    between two steps gets its first token in the very next step, and a token in every step after."""
    engine = make_engine(search_dir, max_num_batched_tokens=16)
    engine.add_request("search", SEARCH_PROMPTS[0], dataclasses.replace(search(0.6, 16), max_tokens=10))
    for _ in range(3):
        engine.step()
    engine.add_request("greedy", SEARCH_PROMPTS[2], SEARCH_GREEDY)  # two tokens: within its share
    for _ in range(4):
        outs = {o.request_id: o for o in engine.step()}
        assert "greedy" in outs and len(outs["greedy"].outputs[0].delta_token_ids) == 1
        assert {s.group.request_id for s in engine.step_runner.scheduled} == {"search", "greedy"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)
