"""The speculative step, stage by stage, and proposers of every shape through the same engine path.

A zero-cost lookup proposer and a proposer that reads the target's hidden states (a random head)
are registered here like any method; the engine never branches on them.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import VOCAB, build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler import SchedulerOutput
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk
from engine.sampling.batch import Batch, Sample
from engine.sampling.tree import DraftTree
from engine.speculative.controller import CostModel, ExplorationBudget, Guard
from engine.speculative.methods import register
from engine.speculative.proposer import CostShape, Proposer


@register
class LookupProposer(Proposer):
    """Prompt lookup: find the last token's previous occurrence and copy what followed. No model cost."""

    method = "test-lookup"
    cost = CostShape(kind=None)

    def __init__(self) -> None:
        self.calls = 0

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids):
        return cls()

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return depth

    def propose(self, seqs, depths, ctx):
        self.calls += 1
        out = []
        for s, d in zip(seqs, depths):
            ids = s.token_ids
            last = ids[-1]
            hit = max((i for i in range(len(ids) - 1) if ids[i] == last), default=None)
            out.append(DraftTree.chain(ids[hit + 1 : hit + 1 + d]) if hit is not None else DraftTree())
        return out


@register
class HiddenHeadProposer(Proposer):
    """Medusa-like random heads on the target's last-layer hidden state of the last computed token."""

    method = "test-hidden"
    cost = CostShape(kind=None)

    def __init__(self, layer: int, hidden: int, vocab: int, max_depth: int) -> None:
        self.hidden_layers = (layer,)
        g = torch.Generator().manual_seed(0)
        self.heads = torch.randn(max_depth, hidden, vocab, generator=g)
        self.seen: dict[int, int] = {}  # seq_id → tokens whose hidden states were handed over
        self.rows_ok = True

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids):
        cfg = target.hf_config
        return cls(cfg.num_hidden_layers - 1, cfg.hidden_size, cfg.vocab_size, config.num_speculative_tokens)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return depth

    def on_computed(self, seq, start, hidden):
        rows = hidden[self.hidden_layers[0]]
        # A prompt may start after a prefix-cache hit; after that the ranges follow each other.
        self.rows_ok &= seq.seq_id not in self.seen or start == self.seen[seq.seq_id]
        self.seen[seq.seq_id] = start + rows.shape[0]

    def on_preempt(self, seq):
        self.seen.pop(seq.seq_id, None)

    def propose(self, seqs, depths, ctx):
        out = []
        for s, d in zip(seqs, depths):
            h = ctx.hidden_states[s.seq_id][self.hidden_layers[0]][-1]  # the newest final token's state
            out.append(DraftTree.chain([int((h @ self.heads[i]).argmax()) for i in range(d)]))
        return out


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_model_dir(tmp_path_factory.mktemp("step") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3)


def make(target, method=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(target), speculative_method=method, device="cpu", **kw))


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].delta_token_ids for o in engine.generate(prompts, params)]


def check_n_choices(plain: LLMEngine, eng: LLMEngine, seed: int = 7) -> None:
    """An n = 3 greedy request through ``eng``, speculating at depth 3, gives the plain engine's
    choices, each choice drafted (its proposer heard of its own verified drafts), and every KV block
    comes back."""
    prompt = prompts(1, seed)[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=3)
    want = [c.delta_token_ids for c in plain.generate([prompt], params)[0].outputs]
    drafted: set[int] = set()
    on_verified = eng.proposer.on_verified

    def heard(seq, tree, kept):
        drafted.add(seq.seq_id)
        return on_verified(seq, tree, kept)

    eng.proposer.on_verified = heard
    try:
        out = eng.generate([prompt], SamplingParams(**{**params.__dict__, "num_draft_tokens": 3}))[0]
    finally:
        del eng.proposer.on_verified
    assert [c.delta_token_ids for c in out.outputs] == want
    assert len(drafted) == 3 and out.stats.num_draft_tokens > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Repetitive prompts so that lookup finds something to copy.
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
        out.append((motif * 6)[: rng.randint(6, 24)])
    return out


@pytest.mark.parametrize("method", ["test-lookup", "test-hidden"])
def test_every_proposer_shape_is_exact_through_the_engine(target, method):
    ps = prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
    plain = run(make(target), ps, params)
    eng = make(target, method, num_kv_blocks=40, max_num_batched_tokens=48)  # small pool: preemption too
    assert run(eng, ps, params) == plain
    st = eng.spec_stats
    assert st.num_drafts > 0
    if method == "test-lookup":
        assert st.num_accepted_tokens > 0, "repetitive text: lookup should be right sometimes"
    else:
        assert eng.proposer.rows_ok, "hidden states must be handed over for contiguous token ranges"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_hidden_states_handed_over_are_the_targets(target):
    eng = make(target, "test-hidden", num_speculative_tokens=2)
    eng.add_request("h", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        eng.step()
    seq = eng.groups["h"].seqs[0]
    layer = eng.proposer.hidden_layers[0]
    got = eng.step_runner._hidden[seq.seq_id][layer][-1]
    # A fresh forward over the same tokens gives the same hidden state at the last computed token.
    fresh = make(target)
    table: list[int] = []
    n = seq.num_computed_tokens
    fresh.block_manager.reserve(table, 0, n)
    out = fresh.runner.forward([ForwardChunk(seq.token_ids[:n], 0, table, 1)], hidden_layers=(layer,))
    torch.testing.assert_close(got, out.hidden_states[layer][n - 1], atol=1e-4, rtol=1e-4)


def test_lookup_that_finds_nothing_costs_no_draft_work(target):
    """A step whose lookup found nothing feeds the target exactly what plain decoding would (one token)."""
    eng = make(target, "test-lookup", num_speculative_tokens=3)
    found: list[bool] = []
    fed: list[int] = []
    propose, forward = eng.proposer.propose, eng.runner.forward

    def spy_propose(seqs, depths, ctx):
        trees = propose(seqs, depths, ctx)
        found.append(any(len(t) for t in trees))
        return trees

    def spy_forward(chunks, **kw):
        fed.append(sum(len(c.token_ids) for c in chunks))
        return forward(chunks, **kw)

    eng.proposer.propose, eng.runner.forward = spy_propose, spy_forward
    prompt = list(range(3, 23))  # no token repeats: the first decode steps find nothing to copy
    # A pinned depth: the lookup is asked every step (the controller, pricing drafts by measured
    # times, may rightly ask for none in 12 tokens; the test would then depend on the host's speed).
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    eng.add_request("q", prompt, params)
    steps: list[tuple[bool | None, int]] = []
    while eng.has_unfinished_requests():
        before = len(found)
        eng.step()
        steps.append((found[-1] if len(found) > before else None, fed[-1]))
    misses = [n for hit, n in steps if hit is False]
    assert misses, "the lookup was asked and found nothing at least once"
    assert all(n == 1 for n in misses), f"a step without a draft fed {misses} tokens"
    assert eng.spec_stats.num_drafts == sum(1 for hit, _ in steps if hit)


# -- the stages, one by one ----------------------------------------------------------------------------
def test_build_lays_out_prefill_decode_and_tree(target):
    eng = make(target, "test-lookup", num_speculative_tokens=3)
    step = eng.step_runner
    eng.add_request("a", [3, 4, 5, 3, 4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.add_request("b", [9, 10, 11, 12, 13, 14], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # both prompts prefilled, one token each
    a, b = eng.groups["a"].seqs[0], eng.groups["b"].seqs[0]
    eng.add_request("c", [20, 21, 22], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    c = eng.scheduler.waiting[0]
    for s, n in ((a, 4), (b, 1), (c, 3)):  # a: 1 + 3 slots for its tree
        eng.block_manager.reserve(s.block_table, s.num_computed_tokens, s.num_computed_tokens + n)
    tree = DraftTree([7, 8, 9], [-1, -1, 0])
    sched = SchedulerOutput(scheduled=[(a, 1), (b, 1), (c, 3)])
    batch = step.build(sched, {a.seq_id: tree})
    ca, cb, cc = batch.chunks
    assert ca.token_ids == [a.token_ids[-1], 7, 8, 9] and ca.positions == [a.num_tokens - 1 + d for d in (0, 1, 1, 2)]
    assert ca.tree_mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert (cb.token_ids, cb.num_logits) == ([b.token_ids[-1]], 1)
    assert (cc.token_ids, cc.num_logits) == ([20, 21, 22], 1)
    # Logits rows: a's root and nodes (0-3), b's decode (4), c's last prompt token (5).
    assert [(s.seq, s.row, s.tok, len(s.tree)) for s in batch.samples] == [(a, 0, 0, 3), (b, 4, 4, 0), (c, 5, 7, 0)]
    assert batch.samples[0].depth == tree.depth == 2  # the controller learns from the levels really drafted
    assert [(s, start, n) for s, start, n, _ in batch.computed] == [(b, b.num_tokens - 1, 1), (c, 0, 3)]


def test_accept_greedy_walks_the_tree_and_commit_moves_kv(target):
    eng = make(target, "test-lookup", num_speculative_tokens=3)
    step = eng.step_runner
    eng.add_request("a", [3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    a = eng.groups["a"].seqs[0]
    c = a.num_computed_tokens
    eng.block_manager.reserve(a.block_table, c, c + 4)
    tree = DraftTree([7, 8, 9], [-1, -1, 1])  # root → 7, root → 8 → 9
    sample = Sample(a, tree, 0, 0, depth=2)
    batch = Batch(samples=[sample])
    logits = torch.full((4, VOCAB), -10.0)
    logits[0, 8] = logits[2, 9] = logits[3, 42] = 10.0  # the target says 8, then 9, then 42
    emits = step.accept(batch, logits)
    assert emits[0].tokens == [8, 9, 42] and sample.accepted == [1, 2]
    # Accepted nodes 1 and 2 were fed at slots c+2, c+3; they belong at c+1, c+2.
    bs = eng.config.block_size
    slot = lambda i: a.block_table[i // bs] * bs + i % bs  # noqa: E731
    kv = eng.runner.kv_cache
    kv[:, :, slot(c + 2)] = 2.0
    kv[:, :, slot(c + 3)] = 3.0
    step.commit(batch, emits, {})
    assert a.num_computed_tokens == c + 3
    assert torch.all(kv[:, :, slot(c + 1)] == 2.0) and torch.all(kv[:, :, slot(c + 2)] == 3.0)


# -- the controller ------------------------------------------------------------------------------------
def test_cost_model_median_ignores_one_noisy_timing():
    cost = CostModel()
    for _ in range(6):
        cost.observe("target", 4, 8, 0.010)
    cost.observe("target", 4, 8, 0.500)  # one stall (a page fault, another process)
    assert cost.predict("target", 4, 8) == pytest.approx(0.010)


def test_cost_model_scales_drafting_by_whole_steps_and_counts_host_time():
    cost = CostModel()
    assert cost.spec_scale() == 1.0
    for r in (0.5, 0.6, 9.0, 0.55, 0.01):  # medians, clipped: one stall or one freak step moves nothing
        cost.observe_spec_scale(r)
    assert cost.spec_scale() == pytest.approx(0.55)
    cost.observe_host(0.002, num_seqs=2, num_drafting=0)  # 1 ms per sequence in a plain step
    cost.observe_host(0.005, num_seqs=2, num_drafting=1)  # 3 ms more for the drafting one
    assert cost.host_seconds(4, 2) == pytest.approx(4 * 0.001 + 2 * 0.003)


def _controlled_engine(target, tmp_path) -> tuple[LLMEngine, object]:
    """An engine whose draft is the target itself (chains), and its controller."""
    from test_spec import noisy_copy

    draft = noisy_copy(target, tmp_path / "d", 0.0)
    cfg = EngineConfig(
        model=str(target), draft_model=str(draft), device="cpu", num_kv_blocks=256, block_size=4, spec_tree_topk=1
    )
    eng = LLMEngine(cfg)
    eng.controller.trial_steps = 0  # requests start from the estimates a test sets, not with trial drafts
    return eng, eng.controller


def test_controller_hysteresis(target, tmp_path):
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    ctl.guard.min_samples = 0  # this part is about the plan alone: no early plain probes
    ctl.reuse_plans = 0  # and every plan searches (hysteresis counts searched plans)
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    ctl.cost = cheap_draft_costs()
    ctl.estimate(seq).alpha = [0.95] * 4
    assert ctl.plan([seq], 0) == [4]
    # Depth 3 becomes slightly better than 4 (about 1%, within the switching margin): one plan does
    # not flip the depth, several in a row do.
    ctl.estimate(seq).alpha = [0.95, 0.95, 0.95, 0.28]
    assert ctl.plan([seq], 0) == [4] and ctl.depth[True] == 4
    plans = [ctl.plan([seq], 0) for _ in range(ctl.patience)]
    assert plans[-1] == [3] and ctl.depth[True] == 3
    # A clearly better depth (well beyond the margin) is taken at once.
    ctl.estimate(seq).alpha = [0.5, 0.05, 0.05, 0.05]
    assert ctl.plan([seq], 0) == [1]


def test_guard_turns_off_a_losing_bucket_and_bursts_back_at_full_depth():
    # Speculating steps measured slower than plain ones at the same batch size turn the bucket off:
    # a true bypass (depth 0), judged on the ratio of sums, not on one step.
    guard = Guard(max_depth=4, min_samples=4, probe_every=8, burst=4)
    for _ in range(4):
        guard.observe(1, 1, 0.010, speculated=False)  # plain: 100 tok/s
    guard.observe(1, 3, 0.010, speculated=True)  # one fast step among slow ones
    for _ in range(3):
        guard.observe(1, 2, 0.030, speculated=True)  # speculating: 67 tok/s in sum
    b = guard.bucket(1)
    assert not b.on and guard.limit(1) == 0
    # While off: plain steps, then a burst of full-depth speculating steps every `interval` plans,
    # which the controller tells by a positive limit while off; the burst's first step (the catch-up) is not judged.
    limits, exploring = [], []
    for _ in range(7 + 4):
        limits.append(guard.limit(1))
        exploring.append(limits[-1] > 0 and not b.on)  # a burst step: the controller drafts at full depth
        if limits[-1]:
            guard.observe(1, 5, 0.020, speculated=True)  # the burst wins: 250 tok/s
    assert limits == [0] * 6 + [4] * 4 + [4] and exploring == [False] * 6 + [True] * 4 + [False]
    assert b.on and len(b.spec) == 3 + 1  # judged at the plan after the burst (3 judged steps): back on
    assert b.probation == guard.window - 1  # on probation (one step of it run): the burst may have kept up by luck
    # Speculation loses during the probation: the burst's verdict was wrong, so the bucket turns off
    # as after a lost burst, the interval doubled (not back to probe_every: no flapping).
    for _ in range(4):
        guard.observe(1, 1, 0.050, speculated=True)
    assert not b.on and b.probation == 0 and b.interval == 16
    limits = []
    for _ in range(16 + 4 + 32):
        limits.append(guard.limit(1))
        if limits[-1]:
            guard.observe(1, 1, 0.030, speculated=True)  # 33 tok/s: still losing
    # A burst that loses doubles the interval before the next one.
    assert limits[:16] == [0] * 15 + [4] and b.interval == 32 and limits[-1] == 4 and not b.on
    assert limits.count(4) < 4 + 4  # the second burst stopped early (below `abort` x plain)


def test_a_bucket_on_probation_is_charged_and_turned_off_when_the_budget_cannot_pay():
    """After a burst turns a bucket on: its probation steps are exploration to the controller (charged
    to the budget); a probation the budget can no longer pay for ends like a lost burst; one that runs
    its course makes the bucket's next loss a fresh one (the next burst probe_every plans away)."""
    guard = Guard(max_depth=4, min_samples=2, probe_every=4, burst=2, window=4)
    b = guard.bucket(1)
    for _ in range(2):
        guard.observe(1, 1, 0.010, speculated=False)
    b.on, b.interval, b.wait = False, 8, 1
    limits = []
    for _ in range(3):
        limits.append(guard.limit(1))
        if limits[-1]:
            guard.observe(1, 2, 0.010, speculated=True)  # a burst that wins: 200 tok/s
    assert limits == [4, 4, 4] and b.on and b.probation == 3  # on probation, one step of it run
    # A burst that kept up while the budget is spent waits for it: no step drafts unpaid, and it is not
    # mistaken for a lost one.
    waiting = Guard(max_depth=4, min_samples=2, probe_every=4, burst=2, window=4)
    w = waiting.bucket(1)
    for _ in range(2):
        waiting.observe(1, 1, 0.010, speculated=False)
    w.on, w.interval, w.wait = False, 8, 1
    for _ in range(2):  # a burst of two steps that wins (its first, the catch-up, is not judged)
        assert waiting.limit(1) == 4
        waiting.observe(1, 2, 0.010, speculated=True)
    assert [waiting.limit(1, may_probe=False) for _ in range(3)] == [0, 0, 0] and not w.on and w.interval == 8
    assert waiting.limit(1) == 4 and w.on and w.probation == 4
    assert guard.limit(1, may_probe=False) == 0  # the budget is spent: the probation ends, off
    assert not b.on and b.interval == 16 and b.wait == 16
    # A probation that runs its course: the bucket stays on, and a later loss starts over at probe_every.
    b.on, b.probation = True, 2
    for _ in range(2):
        guard.observe(1, 2, 0.010, speculated=True)
    assert b.on and b.probation == 0 and guard.limit(1, may_probe=False) == 4  # no budget needed now
    for _ in range(4):
        guard.observe(1, 1, 0.050, speculated=True)
    assert not b.on and b.interval == 4


def test_guard_learns_plain_early_and_keeps_it_current():
    # A fresh bucket learns plain decoding's rate early: every 4th step is plain until it has
    # min_samples plain samples; while on, a plain step every probe_every plans keeps it current.
    fresh = Guard(max_depth=4, min_samples=5, probe_every=10**9)
    limits = []
    for _ in range(24):
        limits.append(fresh.limit(1))
        fresh.observe(1, 1, 0.010, speculated=limits[-1] > 0)
    assert limits[3::4][:5] == [0] * 5 and limits[23] == 4 and limits.count(0) == 5
    probing = Guard(max_depth=4, min_samples=0, probe_every=3)
    assert [probing.limit(1) for _ in range(6)] == [4, 4, 0, 4, 4, 0]


def test_guard_keeps_greedy_and_sampled_batches_apart():
    """Sampled traffic on which speculation loses must not stop speculation for greedy traffic."""
    guard = Guard(max_depth=4, probe_every=10**9)
    for _ in range(8):
        guard.observe(1, 1, 0.010, speculated=False, greedy=False)
    for _ in range(60):
        guard.observe(1, 2, 0.030, speculated=True, greedy=False)
    assert guard.limit(1, greedy=False) == 0
    assert max(guard.limit(1, greedy=True) for _ in range(3)) == 4


def test_controller_drafts_full_depth_in_a_guard_burst_and_no_idle_probe_while_off(target, tmp_path):
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    ctl.cost = cheap_draft_costs(target_per_token=0.05)  # every drafted token costs: the plan says 0
    ctl.estimate(seq).alpha = [0.3] * 4
    ctl.guard = Guard(4, min_samples=0, probe_every=10**9)
    assert ctl.plan([seq], 0) == [0]
    b = ctl.guard.bucket(1)
    b.on, b.wait, b.interval = False, 3, 3
    seq.spec_idle_steps = 10**6  # an idle probe would be due, but the guard's bucket is off
    plans = [ctl.plan([seq], 0) for _ in range(3)]
    assert plans == [[0], [0], [4]]  # the burst drafts at full depth, whatever the plan would say


def test_controller_reuses_the_plan_of_an_unchanged_batch(target, tmp_path):
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    ctl.cost = cheap_draft_costs()
    ctl.guard = Guard(4, min_samples=0, probe_every=10**9)
    ctl.estimate(seq).alpha = [0.95] * 4
    searched = []
    ctl._best_at = lambda D, *a, f=ctl._best_at: searched.append(D) or f(D, *a)
    assert ctl.plan([seq], 0) == [4] and len(searched) == 5  # a search over depths 0..4
    assert all(ctl.plan([seq], 0) == [4] for _ in range(ctl.reuse_plans)) and len(searched) == 5
    assert ctl.plan([seq], 0) == [4] and len(searched) == 10  # reused at most reuse_plans times
    ctl.estimate(seq).alpha = [0.05] * 4  # new estimates: a new search at once
    seq.spec_idle_steps = -(10**6)  # (and no idle probe here)
    assert ctl.plan([seq], 0) == [0] and len(searched) == 15
    # A plan that drafts nothing is reused longer: nothing moves its estimates while it stands.
    assert all(ctl.plan([seq], 0) == [0] for _ in range(ctl.reuse_idle_plans)) and len(searched) == 15
    assert ctl.plan([seq], 0) == [0] and len(searched) == 20


def _decoding_batch(target, path, n: int) -> tuple[LLMEngine, object, list]:
    """A controlled engine (see ``_controlled_engine``) with ``n`` greedy requests all decoding, in
    the order of their ids."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng, ctl = _controlled_engine(target, path)
    for i in range(n):
        eng.add_request(f"r{i}", [5, 6, 7, 8 + i], params)
    while len(eng.scheduler.running) < n or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    return eng, ctl, sorted(eng.scheduler.running, key=lambda s: s.seq_id)


@pytest.mark.parametrize("pays", [True, False], ids=["probes-pay", "probes-cannot-pay"])
def test_an_idle_plan_is_answered_without_a_search_and_probes_when_the_search_would(target, tmp_path, pays):
    """A batch whose plan drafts nothing gets that answer again without a search for as long as the
    search would reuse it (``reuse_idle_plans``), serving its requests' trials and idle probes as the
    search would: over 80 steps its plans (idle probes at full depth among them, where they could pay)
    and its requests' idle counts are those of a controller that searches every step, with a fraction
    of the searches. Where no probe could pay (every drafted token costs a step's worth), the probes
    that fall due, and those the exploration budget holds back, do not end the run. A step with other
    requests searches at once."""
    from test_spec import cheap_draft_costs

    runs = {}
    for fast in (True, False):
        _, ctl, seqs = _decoding_batch(target, tmp_path / str(fast), 4)
        ctl.cost = cheap_draft_costs() if pays else cheap_draft_costs(target_per_token=0.05)
        ctl.guard = Guard(4, min_samples=0, probe_every=10**9)
        for k, s in enumerate(seqs):
            ctl.estimate(s).alpha = [0.05] * 4  # too little to draft, but a probe could pay
            s.spec_idle_steps = 3 * k  # probes due at different steps
        if not fast:
            ctl.reuse_idle_plans = 0  # the reference: a search every step
        searched = []
        ctl._plan = lambda *a, f=ctl._plan, n=searched: n.append(1) or f(*a)
        plans = []
        for t in range(80):
            if not pays:  # the budget holds every probe back for a while, then lets them in
                ctl.budget.spent = 1.0 if 20 <= t < 50 else 0.0
            plans.append((ctl.plan(seqs, 0), [s.spec_idle_steps for s in seqs]))
        runs[fast] = plans, len(searched)
        if fast:
            before = len(searched)
            assert ctl.plan(seqs[:3], 0) == [0, 0, 0] and len(searched) == before + 1  # another batch
    (plans, searches), (reference, every) = runs[True], runs[False]
    assert plans == reference and every == 80
    if pays:
        assert sum(d > 0 for p, _ in plans for d in p) >= 8 and searches < 20  # the probes, at the same steps
    else:
        assert not any(d for p, _ in plans for d in p) and searches <= 4
        assert any(max(idle) > ctl.idle_probe for _, idle in plans)  # probes held back by the budget


def test_a_batch_the_guard_holds_plain_is_planned_as_the_guard_would_without_asking_it(target, tmp_path):
    """While the guard's bucket is off, the same batch's next plans are answered without a plan
    (``SpecController._held_plain``): over 300 plans (bursts that lose, a budget that holds the next
    one back, requests leaving and joining, a request at its last token) the plans, each request's
    reason and the guard's state step by step are those of a controller that plans every time, with a
    fraction of the guard's answers asked."""
    from test_spec import cheap_draft_costs

    runs = {}
    for fast in (True, False):
        _, ctl, seqs = _decoding_batch(target, tmp_path / str(fast), 3)
        ctl.cost = cheap_draft_costs()
        ctl.guard = Guard(4, min_samples=4, probe_every=8, burst=3, max_interval=32)
        ctl.budget = ExplorationBudget(fraction=0.2, decay=1.0)
        for s in seqs:
            ctl.estimate(s).alpha = [0.95] * 4  # the plan would draft: only the guard keeps it plain
        if not fast:
            ctl._held_plain = lambda batch, room: False  # the reference: every plan asks the guard
        asked = []
        ctl.guard.limit = lambda *a, f=ctl.guard.limit, n=asked, **k: n.append(1) or f(*a, **k)
        trace = []
        for t in range(300):
            batch = seqs[:2] if t < 100 else seqs[1:2] if t < 200 else seqs
            room = [0 if t % 70 == 69 and s is batch[0] else 5 for s in batch]
            depths = ctl.plan(batch, 0, room)
            b = ctl.guard.bucket(len(batch))
            if t == 20:
                b.on = False  # it lost: the guard's verdict
            if any(depths):  # a burst, losing: 1 token a step in three plain steps' time
                ctl.guard.observe(len(batch), len(batch), 0.03, True, members=frozenset(s.seq_id for s in batch))
                ctl.budget.observe(0.03, 0.02)
            else:
                ctl.observe_ahead(batch, 0.01)
            state = {k: (v.on, v.wait, v.interval, v.plans, v.burst_left) for k, v in ctl.guard.buckets.items()}
            trace.append((depths, [s.spec_reason for s in batch], state, ctl.budget.allows()))
        runs[fast] = trace, len(asked)
    (trace, asked), (reference, every) = runs[True], runs[False]
    assert trace == reference
    late = sum(any(depths) for depths, *_ in trace[200:])  # bursts of a bucket that has been off since t = 20
    held_back = sum(not allows and any(b[1] == 1 and not b[0] for b in state.values()) for *_, state, allows in trace)
    assert late >= 3 and held_back >= 20  # bursts ran, and the budget held them back for a while
    assert {r for _, reasons, *_ in trace for r in reasons} == {"cost", "load", None}
    assert every == 300 and asked < 100


def test_a_long_catch_up_does_not_price_later_drafts(target, tmp_path):
    """A request's first drafts feed the draft its whole prompt: that step's whole-step ratio and host
    time stay out of the cost model (else a few of them price every later draft at several times
    its cost); a steady step's go in."""
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    ctl.cost = cost = cheap_draft_costs()
    cost.take_step_tokens("draft")
    cost.observe_host(0.001, num_seqs=1, num_drafting=0)
    batch = Batch(samples=[Sample(seq, DraftTree.chain([9, 9, 9, 9]), 0, 0, depth=4)])

    def drafting_step(catch_up: int) -> None:
        for tokens in (catch_up, 1, 1, 1):  # the catch-up forward, then three draft levels
            cost.observe("draft", 1, tokens, 0.001)
        ctl.observe_step(1, 3, 0.030, 0.014, 1, batch)  # 15 ms of it beyond the forwards' parts

    drafting_step(catch_up=200)
    assert not cost.spec_ratio and not cost.host_per_draft
    drafting_step(catch_up=2)
    assert len(cost.spec_ratio) == 1 and len(cost.host_per_draft) == 1
    assert cost.host_seconds(1, 1) == pytest.approx(0.016)
    # Plain steps in between reset the count: each step is judged on its own forwards.
    cost.observe("draft", 1, 300, 0.001)
    ctl.observe_step(1, 1, 0.012, 0.011, 0, Batch(samples=[Sample(seq, DraftTree(), 0, 0)]))
    drafting_step(catch_up=2)
    assert len(cost.spec_ratio) == 2


def test_controller_explores_at_full_depth_where_it_could_pay_and_unjudged(target, tmp_path):
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    ctl.trial_steps, ctl.idle_probe = 3, 5
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    ctl.cost = cheap_draft_costs()  # a draft forward is a tenth of a target forward
    ctl.guard = Guard(4, min_samples=0, probe_every=10**9)
    ctl.budget = ExplorationBudget(fraction=10**9)  # this part is about what explores, not how often
    ctl.estimate(seq).alpha = [0.05] * 4  # its population says drafting does not pay: the search says 0
    batch = Batch(samples=[Sample(seq, DraftTree(), 0, 0, depth=4)])
    plans = []
    for _ in range(ctl.trial_steps):  # its first drafts are at full depth all the same
        plans.append(ctl.plan([seq], 0))
        assert ctl.exploring
        ctl.observe_step(1, 1, 0.05, 0.04, 1, batch)  # a losing step: exploration, not the plan's choice
        ctl.update(seq, 4, 0)
    assert plans == [[4]] * ctl.trial_steps and not ctl.guard.bucket(1).spec
    # Then the plan decides (0 here); a request kept at 0 drafts at full depth every idle_probe steps.
    plans = [ctl.plan([seq], 0) for _ in range(2 * ctl.idle_probe)]
    assert plans == ([[0]] * (ctl.idle_probe - 1) + [[4]]) * 2
    # Where drafting costs more than even the most predictable text returns (every target token
    # costs: a saturated device), neither a new request nor an idle one explores.
    ctl.cost = cheap_draft_costs(target_per_token=0.05)
    eng.add_request("y", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    new = eng.groups["y"].seqs[0]
    assert ctl.estimate(new).updates == 0
    assert all(ctl.plan([new], 0) == [0] and not ctl.exploring for _ in range(2 * ctl.idle_probe))


def test_exploration_budget_keeps_losing_exploration_to_its_share(target, tmp_path):
    """Short requests one at a time, each trialled at full depth, where drafting always loses (a
    trial step takes 4 plain tokens' time and makes 1 token): what exploring loses against plain
    decoding stays within the budget's share of the time, yet exploring goes on."""
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    ctl.trial_steps = 1
    ctl.cost = cheap_draft_costs()  # drafting could pay by the cost model: trials are due
    ctl.guard = Guard(4, min_samples=0, probe_every=10**9)
    ctl.budget = budget = ExplorationBudget(fraction=0.05, decay=1.0)  # no decay: the exact share
    plain, lost, total, trials = 0.010, 0.0, 0.0, 0
    for r in range(120):
        eng.add_request(f"r{r}", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        eng.step()
        ctl.cost = cheap_draft_costs()  # the real prefill's timing would move the plan with the host's load
        seq = eng.groups[f"r{r}"].seqs[0]
        for _ in range(8):  # eight steps of each request
            ctl.estimate(seq).alpha = [0.05] * 4  # the plan alone would keep it at 0
            depth = ctl.plan([seq], 0)[0]
            seconds = 4 * plain if depth else plain
            trials += depth > 0
            lost += seconds - plain if depth else 0.0
            total += seconds
            ctl.observe_step(
                1, 1, seconds, seconds, int(depth > 0), Batch(samples=[Sample(seq, DraftTree(), 0, 0, depth=depth)])
            )
        eng.abort(f"r{r}")
    assert lost <= budget.fraction * total + 4 * plain  # within the share, but for the step that crossed it
    assert budget.spent == pytest.approx(lost, rel=0.01)  # charged what it lost (the first by the cost model)
    assert 10 < trials < 120  # explored now and then, not every request
    # Exploration that wins (a trial step makes 4 tokens in 2 plain tokens' time) is never held back.
    ctl.budget = ExplorationBudget(fraction=0.05)
    eng.add_request("w", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    eng.step()
    wins = []
    for r in range(30):
        eng.add_request(f"w{r}", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        eng.step()
        ctl.cost = cheap_draft_costs()
        seq = eng.groups[f"w{r}"].seqs[0]
        ctl.estimate(seq).alpha = [0.05] * 4
        wins.append(ctl.plan([seq], 0)[0])
        ctl.observe_step(1, 4, 2 * plain, 2 * plain, 1, Batch(samples=[Sample(seq, DraftTree(), 0, 0, depth=4)]))
        eng.abort(f"w{r}")
    assert wins == [4] * 30 and ctl.budget.spent < 0


def test_controller_charges_a_probation_to_the_exploration_budget_and_lets_the_guard_judge_it(target, tmp_path):
    """A bucket a burst turned on: the controller's drafting steps are charged to the budget (what they
    lose against plain decoding) and still judged by the guard; once the probation is over they are not
    charged."""
    from test_spec import cheap_draft_costs

    eng, ctl = _controlled_engine(target, tmp_path)
    ctl.cost = cheap_draft_costs()
    ctl.guard = Guard(4, min_samples=8, probe_every=10**9)  # 3 speculating steps: no verdict yet
    ctl.budget = ExplorationBudget(fraction=0.5, decay=1.0)
    eng.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    eng.step()
    seq = eng.groups["x"].seqs[0]
    b = ctl.guard.bucket(1)
    b.probation = 2
    plain = 0.010
    for _ in range(20):
        ctl.observe_step(1, 1, plain, plain, 0, Batch(samples=[Sample(seq, DraftTree(), 0, 0, depth=0)]))
    charged = []
    for _ in range(3):
        ctl.estimate(seq).alpha = [0.9] * 4  # the plan drafts
        depth = ctl.plan([seq], 0)[0]
        assert depth > 0 and ctl.on_probation == (b.probation > 0) and not ctl.exploring
        spent, judged = ctl.budget.spent, len(b.spec)
        # two tokens in three plain tokens' time: a loss of one plain token's time
        ctl.observe_step(1, 2, 3 * plain, 3 * plain, 1, Batch(samples=[Sample(seq, DraftTree(), 0, 0, depth=depth)]))
        charged.append(round(ctl.budget.spent - spent, 6))
        assert len(b.spec) == judged + 1  # the guard judged it
    assert charged == [plain, plain, 0.0] and b.probation == 0


def test_guard_burst_waits_for_the_exploration_budget():
    guard = Guard(max_depth=4, min_samples=0, probe_every=4)
    b = guard.bucket(1)
    b.on = False
    assert [guard.limit(1, may_probe=False) for _ in range(10)] == [0] * 10  # due after 4, held back
    assert guard.limit(1) == 4 and b.probing  # the budget allows: the burst starts at once


def test_budget_lets_no_step_in_that_would_overdraw_it_and_a_burst_stops_when_it_is_spent():
    budget = ExplorationBudget(fraction=0.05, decay=1.0)
    for _ in range(100):
        budget.observe(0.010)  # one second of plain steps: a 0.05 s share
    assert budget.allows()  # nothing explored yet: nothing to forecast
    budget.observe(0.050, excess=0.040)  # an exploring step lost 0.04 s (a request's first draft, say)
    # 0.04 spent is within the share, but the next such step would take it to 0.08: it waits ...
    assert budget.spent <= budget.fraction * budget.elapsed and not budget.allows()
    for _ in range(60):
        budget.observe(0.010)
    assert budget.allows()  # ... until the share covers it too
    guard = Guard(max_depth=4, min_samples=2, probe_every=2, burst=10)
    b = guard.bucket(1)
    for _ in range(2):
        guard.observe(1, 1, 0.010, speculated=False)
    b.on = False
    depths = []
    for _ in range(5):  # a burst runs, at 0.9x plain decoding (not lost enough to stop by itself) ...
        depths.append(guard.limit(1))
        if depths[-1]:
            guard.observe(1, 1, 0.011, speculated=True)
    assert depths == [0, 4, 4, 4, 4] and b.burst_left > 0
    assert guard.limit(1, may_probe=False) == 0 and b.burst_left == 0  # ... until the budget is spent,
    assert not b.on and not b.probing and b.interval == 4  # judged on the steps it ran: lost, waits longer


def test_guard_verdict_expires_with_the_requests_it_was_about():
    guard = Guard(max_depth=4, min_samples=2, probe_every=8, max_interval=64)
    old, new = frozenset({1}), frozenset({2})
    for _ in range(2):
        guard.observe(1, 1, 0.010, speculated=False, members=old)
    for _ in range(2):
        guard.observe(1, 1, 0.030, speculated=True, members=old)
    b = guard.bucket(1)
    assert not b.on and b.judged == old
    b.interval = b.wait = 64  # it had lost for a while
    assert [guard.limit(1, members=old) for _ in range(8)] == [0] * 8 and b.wait == 56
    # A new request alone in the batch: the next burst is at most probe_every plans away.
    limits = [guard.limit(1, members=new) for _ in range(8)]
    assert limits == [0] * 7 + [4]


# -- the draft model: prefix reuse and chunked catch-up ------------------------------------------------
def test_draft_prefix_cache_hit_skips_catch_up_and_catch_up_is_chunked(target, tmp_path):
    from test_spec import noisy_copy

    draft = noisy_copy(target, tmp_path / "d", 0.3)
    cfg = dict(
        model=str(target), draft_model=str(draft), device="cpu", num_kv_blocks=256, block_size=4, spec_tree_topk=1
    )
    cfg["max_num_batched_tokens"] = 16
    prompt = [random.Random(3).randrange(3, VOCAB) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    plain = run(make(target, num_kv_blocks=256, block_size=4), [prompt], params)

    eng = LLMEngine(EngineConfig(**cfg))
    fed: list[int] = []
    orig = eng.proposer.timings

    def spy():
        t = orig()
        fed.extend(tokens for _, _, tokens, _ in t)
        return t

    eng.proposer.timings = spy
    assert run(eng, [prompt], params) == plain
    assert fed and max(fed) <= 16, "catch-up of a 40-token prompt is chunked under the 16-token budget"
    first_total = sum(fed)
    fed.clear()
    assert run(eng, [prompt], params) == plain  # the same prompt again: a prefix-cache hit
    assert sum(fed) < first_total - 24, "the cached prompt blocks' draft KV was reused"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_dtype_auto_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    import engine.config

    cfg = EngineConfig(model="unused", device="cpu")
    assert cfg.torch_dtype == torch.float32
    monkeypatch.setattr(engine.config, "cpu_has_bf16_units", lambda: True)
    assert cfg.torch_dtype == torch.bfloat16
    assert EngineConfig(model="unused", device="cpu", dtype="float32").torch_dtype == torch.float32


def _device_costs(per_token: float) -> CostModel:
    """Forward timings by batch shape: a fixed 10 ms a target forward (1 ms a draft forward) plus
    ``per_token`` seconds for each token in it (a quarter of that for the draft)."""
    cost = CostModel()
    for num_seqs in (1, 2, 4, 8, 16, 32):
        for per in (1, 2, 4, 8):
            tokens = num_seqs * per
            cost.observe("target", num_seqs, tokens, 0.010 + per_token * tokens)
            cost.observe("draft", num_seqs, tokens, 0.001 + per_token / 4 * tokens)
    return cost


def test_under_load_the_plan_finds_the_depth_that_pays_and_prices_it_across_requests(target, tmp_path):
    """Issue 33, item 4: with 8 and with 32 requests decoding, on a device whose forward costs little
    more for more tokens (weights-bound, as a GPU's at these batch sizes), the plan drafts at a depth
    that pays instead of turning drafting off; in one batch, requests whose drafts are kept more often
    draft deeper than the others (one marginal price for the batch's target time); where every token
    costs real time (compute-bound, as on this CPU), the same batch drafts nothing."""
    eng, ctl = _controlled_engine(target, tmp_path)
    ctl.guard.min_samples = 0  # the plan alone: no early plain probes
    ctl.reuse_plans = ctl.reuse_idle_plans = 0  # (the estimates are set by hand below, not observed)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(32):
        eng.add_request(f"r{i}", [5, 6, 7, 8 + i], params)
    while len(eng.scheduler.running) < 32 or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    seqs = sorted(eng.scheduler.running, key=lambda s: s.seq_id)

    def settled(batch: list, alphas: list[float], per_token: float) -> list[int]:
        ctl.cost = _device_costs(per_token)
        for s, a in zip(batch, alphas):
            ctl.estimate(s).alpha = [a] * ctl.max_depth
        return [ctl.plan(batch, 0) for _ in range(ctl.patience + 1)][-1]

    for n in (8, 32):
        batch = seqs[:n]
        depths = settled(batch, [0.8] * n, per_token=2e-5)
        assert min(depths) >= 2 and len(set(depths)) == 1, (n, depths)
        assert settled(batch, [0.8] * n, per_token=2e-3) == [0] * n
        mixed = settled(batch, [0.9, 0.3] * (n // 2), per_token=2e-4)
        assert min(mixed[0::2]) > max(mixed[1::2]), (n, mixed)
        assert max(mixed[0::2]) >= 2, (n, mixed)
