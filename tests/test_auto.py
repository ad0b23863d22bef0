"""``--speculative-method auto``: several proposers in one engine, one chosen per request and step.

The choice follows each request's own acceptance and the measured costs (a request whose text repeats
goes to a lookup, one whose text the draft model predicts stays with it, none where nothing pays);
mixed trees (the n-gram lookup's continuation beside the draft model's tree) are exact, greedy and
sampled (a G-test, which a wrong rule fails); a request may pin a proposer; the server says which
proposers drafted and, where none did, why; the metrics count per proposer.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from test_ngram import samples
from test_spec import (  # noqa: F401
    cheap_draft_costs,
    exact_joint,
    g_statistic,
    g_test_threshold,
    noisy_copy,
    small_vocab_pair,
    tabular_joint,
    tabular_pair,
    wrong_residual,
)
from test_step import make, prompts, run

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.sampling.tree import DraftTree
from engine.sampling.verify import build_verify_input, verify
from engine.speculative.methods.auto import mixed_tree
from server.app import ServerSettings, create_app
from servers import engine_factory, serve


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("auto")
    target = build_model_dir(root / "target", tokenizer_dir, "LlamaForCausalLM", std=0.3)
    return target, noisy_copy(target, root / "same", 0.0)


def auto_engine(target, draft=None, **kw) -> LLMEngine:
    return make(target, "auto", draft_model=str(draft) if draft else None, **kw)


# -- the choice ---------------------------------------------------------------------------------------
def _decoding(eng: LLMEngine, prompt: list[int]):
    eng.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()
    eng.controller.trial_steps = 0
    eng.controller.guard.min_samples = 0  # the plans alone: no early plain probes
    eng.controller.cost = cheap_draft_costs()  # a small draft beside a big target: drafting can pay
    return eng.groups["x"].seqs[0]


def test_the_route_follows_each_requests_own_acceptance(pair):
    target, draft = pair
    eng = auto_engine(target, draft)
    assert eng.proposer.routes() == ("suffix", "ngram", "draft")
    ctl = eng.controller
    seq = _decoding(eng, [5, 6, 7, 8])
    assert eng.proposer.choices() == ("suffix", "draft")  # n-gram lookup rides beside the draft's trees
    # Its text repeats: the lookups keep what they draft, the draft model is often wrong.
    for route, alpha in (("suffix", 0.95), ("ngram", 0.9), ("draft", 0.3)):
        ctl.estimate(seq, route).alpha = [alpha] * ctl.max_depth
    assert ctl.plan([seq], 0)[0] > 0 and seq.spec_route == "suffix"
    # Its text does not: the lookups rarely find a match (and miss when they do); the draft model keeps up.
    for route in ("suffix", "ngram"):
        est = ctl.estimate(seq, route)
        est.alpha, est.found = [0.2] * ctl.max_depth, 0.05
    ctl.estimate(seq, "draft").alpha = [0.9] * ctl.max_depth
    ctl.plan([seq], 0)  # a route stands for a few plans, unless the request's estimates moved
    assert seq.spec_route == "suffix"
    seq.spec_route_age = 0  # (as a verified draft sets it)
    assert ctl.plan([seq], 0)[0] > 0 and seq.spec_route == "draft"
    # Nothing pays: the draft model costs as much as the target and misses, the lookups' drafts miss.
    ctl.estimate(seq, "draft").alpha = [0.1] * ctl.max_depth
    for route in ("suffix", "ngram"):
        ctl.estimate(seq, route).alpha = [0.01] * ctl.max_depth
    for t in (1, 2, 4, 8, 16, 32):
        ctl.cost.observe("draft", 1, t, 0.010)
    ctl._last_key, seq.spec_route_age = None, 0
    assert ctl.plan([seq], 0) == [0] and seq.spec_reason == "acceptance"


def test_a_new_request_starts_from_how_often_its_route_had_a_draft(pair):
    """A lookup that found nothing for the requests before starts a new request's estimate there too
    (its route's population), not at "always has a draft"."""
    target, draft = pair
    eng = auto_engine(target, draft)
    ctl = eng.controller
    seq = _decoding(eng, [5, 6, 7, 8])
    for _ in range(60):
        ctl.asked(seq, "suffix", False)
    assert ctl.population[("suffix", True, None)].found < 0.1
    eng.add_request("y", [9, 10, 11, 12], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    fresh = eng.groups["y"].seqs[0]
    assert ctl.estimate(fresh, "suffix").found < 0.1 and ctl.estimate(fresh, "suffix").updates == 0


def test_switching_to_a_model_drafter_pays_for_the_tokens_it_missed(pair):
    """A draft model that sat some steps out must catch up on every token since before it drafts: the
    route is priced with that (``Proposer.catch_up_tokens``), so a request far behind stays with the
    lookup where one the drafter has kept up with moves to it."""
    target, draft = pair
    eng = auto_engine(target, draft)
    ctl = eng.controller
    seq = _decoding(eng, list(range(5, 205)))
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        ctl.cost.observe("draft", 1, t, 0.0005 * t)  # a draft forward's cost grows with its tokens
    est = ctl.estimate(seq, "suffix")
    est.alpha, est.found = [0.5] * ctl.max_depth, 0.5
    ctl.estimate(seq, "draft").alpha = [0.9] * ctl.max_depth
    assert eng.proposer.catch_up_tokens(seq, "draft") > 200  # the draft has seen none of it
    ctl.plan([seq], 0)
    assert seq.spec_route == "suffix"
    seq.draft_num_computed, seq.spec_route_age = seq.num_tokens - 1, 0  # caught up: only the root to feed
    assert eng.proposer.catch_up_tokens(seq, "draft") == 1
    ctl.plan([seq], 0)
    assert seq.spec_route == "draft"


def test_a_repeating_request_moves_to_a_lookup_through_the_engine(small_vocab_pair):  # noqa: F811
    """A real run: an 8-token vocabulary, whose greedy text soon repeats, and a draft model that is
    another random model (rarely right), priced as a small draft beside a big target (so acceptance
    decides), beside the lookups. The estimates the requests earn move their drafting to the lookups."""
    target, _ = small_vocab_pair
    root = target.parent
    wrong = build_model_dir(root / "wrong", root / "tok", "LlamaForCausalLM", vocab_size=8, seed=321, std=0.5)
    # What the test prices is the routes' estimates, on fixed costs: ordinary steps (run-ahead would plan
    # the next step inside this one, on costs the step has just measured), and a guard that never turns
    # drafting off (it judges by the clock: on a loaded host the estimates would stop moving).
    eng = auto_engine(target, wrong, async_scheduling="off")
    eng.controller.guard.margin = 0.0
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate([[0, 3, 4, 5], [0, 6, 7], [0, 5, 5, 3], [0, 4]]):
        eng.add_request(f"r{i}", prompt, params)
    routes: list[str | None] = []  # each running request's route, step by step
    while eng.has_unfinished_requests():
        eng.controller.cost = cheap_draft_costs()
        eng.step()
        routes += [s.spec_route for s in eng.scheduler.running]
    by = eng.spec_stats.by_method
    assert sum(by.get(name, [0, 0, 0])[2] for name in ("suffix", "ngram")) > by.get("draft", [0, 0, 0])[2], by
    # On 8 tokens the wrong draft's first token is still right often enough that a request whose own
    # lookup estimate dips tries it (and may stay a while): most steps, not all, are the lookups'.
    assert routes.count("draft") < len(routes) / 2, "the requests' drafting should move to the lookups"


# -- mixed trees ----------------------------------------------------------------------------------------
def test_a_mixed_tree_hangs_the_lookup_beside_the_model_and_keeps_q_exact():
    q = torch.softmax(torch.randn(2, 9), -1)
    sampled = DraftTree.chain([4, 5], q, "draft")
    merged, own = mixed_tree(sampled, [4, 6])
    # A sampled model node is never merged, even with the lookup's same token: the lookup's branch
    # hangs under the root, after the model's nodes, with one-hot q rows.
    assert (merged.tokens, merged.parents, own) == ([4, 5, 4, 6], [-1, 0, -1, 2], 2)
    assert torch.equal(merged.q[:2], q) and merged.q[2, 4] == 1 and merged.q[3, 6] == 1 and merged.q[2:].sum() == 2
    greedy = DraftTree.chain([4, 5], None, "draft")
    merged, own = mixed_tree(greedy, [4, 6, 7])  # deterministic: the lookup follows the node it repeats
    assert (merged.tokens, merged.parents, own, merged.source) == ([4, 5, 6, 7], [-1, 0, 0, 2], 2, "draft")
    assert mixed_tree(greedy, [4, 5])[0] is greedy  # nothing new


def tabular_mixed(P: torch.Tensor, Q: torch.Tensor, n: int, seed: int) -> dict:
    """3 tokens per sequence from a tabular target P[last]: each step a sampled chain of 2 from the draft
    Q beside a deterministic lookup chain of 2 (Q's runner-up, then its argmax), as one mixed tree."""
    torch.manual_seed(seed)
    Vt = P.shape[0]
    out = [[] for _ in range(n)]
    while min(len(o) for o in out) < 3:
        active = [i for i in range(n) if len(out[i]) < 3]
        last = torch.tensor([(out[i][-1] if out[i] else 0) for i in active])
        t1 = torch.multinomial(Q[last], 1)[:, 0]
        t2 = torch.multinomial(Q[t1], 1)[:, 0]
        l1 = Q[last].topk(2).indices[:, 1]
        l2 = Q[l1].argmax(-1)
        trees, rows = [], []
        for j in range(len(active)):
            a, b, c = last[j].item(), t1[j].item(), t2[j].item()
            tree, _ = mixed_tree(DraftTree.chain([b, c], torch.stack([Q[a], Q[b]])), [l1[j].item(), l2[j].item()])
            trees.append(tree)
            rows += [P[a]] + [P[t] for t in tree.tokens]
        inp, roots = build_verify_input(torch.stack(rows), trees, Vt)
        res = verify(inp)
        for j, i in enumerate(active):
            out[i].extend([trees[j].tokens[r - roots[j] - 1] for r in res.accepted_rows[j]] + [res.final_tokens[j]])
    counts: dict = {}
    for o in out:
        counts[tuple(o[:3])] = counts.get(tuple(o[:3]), 0) + 1
    return counts


def test_mixed_trees_keep_the_targets_distribution_and_a_wrong_rule_fails(monkeypatch):
    P, Q = tabular_pair()
    n = 24_000
    expected = tabular_joint(P)
    stat, dof = g_statistic(tabular_mixed(P, Q, n, seed=1), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    wrong_residual(monkeypatch)
    stat, dof = g_statistic(tabular_mixed(P, Q, n, seed=2), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


def _count_mixed(eng: LLMEngine) -> list[int]:
    """Wraps the engine's auto proposer to count the mixed trees it drafts (the lookup's nodes beside)."""
    mixed = [0]
    propose = eng.proposer.propose

    def counting(seqs, depths, ctx):
        trees = propose(seqs, depths, ctx)
        mixed[0] += len(eng.proposer._own)
        return trees

    eng.proposer.propose = counting
    return mixed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_trees_give_the_plain_decoders_greedy_output(pair, dtype):
    target, draft = pair
    ps = prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = run(make(target, dtype=dtype), ps, params)
    noisy = noisy_copy(target, target.parent / f"noisy-{dtype}", 0.6)
    eng = auto_engine(target, noisy, dtype=dtype, num_kv_blocks=60, max_num_batched_tokens=64)  # preemption too
    mixed = _count_mixed(eng)
    pinned = SamplingParams(**{**params.__dict__, "speculative_method": "draft", "num_draft_tokens": 3})
    assert run(eng, ps, pinned) == plain
    assert mixed[0] > 0, "repetitive prompts: the lookup's continuation should ride beside the draft"
    assert eng.spec_stats.by_method["draft"][1] > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    # and unpinned (each request's route chosen step by step), in one batch
    assert run(eng, ps, params) == plain
    del draft


def test_mixed_trees_through_the_engine_keep_the_targets_distribution(small_vocab_pair, monkeypatch):  # noqa: F811
    target_dir, draft_dir = small_vocab_pair
    params = SamplingParams(
        temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, num_draft_tokens=3, speculative_method="draft"
    )
    prompt = [0, 3, 4, 3, 4, 3]  # the n-gram lookup continues it nearly every step
    n = 12_800
    expected = exact_joint(target_dir, prompt, params)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "auto", draft_model=str(draft_dir)), expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"
    wrong_residual(monkeypatch)
    stat, dof = g_statistic(samples(target_dir, params, prompt, n, "auto", draft_model=str(draft_dir)), expected, n)
    assert stat > g_test_threshold(dof), f"the wrong rule went unnoticed: G={stat:.1f} dof={dof}"


# -- pinning, the reason, metrics, the defaults -----------------------------------------------------------
def test_a_pinned_proposer_drafts_alone_and_an_unknown_one_is_refused(pair):
    target, draft = pair
    eng = auto_engine(target, draft)
    for method in ("ngram", "suffix", "draft"):
        params = SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, num_draft_tokens=3, speculative_method=method
        )
        out = eng.generate(prompts(2, seed=5), params)
        assert {name for o in out for name in o.stats.drafted_by} <= {method}
    assert any(o.stats.drafted_by for o in out)
    with pytest.raises(ValueError, match="medusa"):
        eng.limits.check([1, 2, 3], SamplingParams(speculative_method="medusa"))


@pytest.fixture(scope="module")
def srv(pair):
    target, draft = pair
    factory = engine_factory(target, speculative_method="auto", draft_model=str(draft))
    with serve(create_app(ServerSettings(served_model_name="m"), factory)) as s:
        yield s


def test_usage_names_the_proposers_or_the_reason(srv):
    client = OpenAI(base_url=srv.base + "/v1", api_key="x")
    motif = "a b c d " * 12
    out = client.completions.create(
        model="m", prompt=motif, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
    )
    spec = out.usage.model_dump()["speculative"]
    if spec["draft_tokens"]:
        assert spec["reason"] is None and spec["method"].split("+")[0] in spec["proposers"]
        assert sum(p["draft_tokens"] for p in spec["proposers"].values()) == spec["draft_tokens"]
    else:
        assert spec["method"] == "none" and spec["reason"] in ("cost", "acceptance", "load", "grammar")
    off = client.completions.create(
        model="m", prompt=motif, max_tokens=8, temperature=0, extra_body={"speculative": {"enabled": False}}
    )
    spec = off.usage.model_dump()["speculative"]
    zeros = {"draft_tokens": 0, "accepted_tokens": 0}
    assert (spec["method"], spec["reason"]) == ("none", "disabled")
    assert spec["proposers"] == {m: zeros for m in ("suffix", "ngram", "draft")}  # every one held, always
    pinned = client.completions.create(
        model="m", prompt=motif, max_tokens=16, temperature=0,
        extra_body={"speculative": {"method": "ngram", "num_draft_tokens": 3}, "ignore_eos": True},
    )  # fmt: skip
    held = pinned.usage.model_dump()["speculative"]["proposers"]
    assert set(held) == {"suffix", "ngram", "draft"} and held["suffix"] == held["draft"] == zeros
    # langchain adds a batch's usages up key by key (ChatOpenAI.generate over several message lists);
    # a nested key one usage lacks made it raise.
    merge = pytest.importorskip("langchain_openai.chat_models.base")._update_token_usage
    total = merge(off.usage.model_dump(), pinned.usage.model_dump())
    assert total["completion_tokens"] == 8 + 16 and total["speculative"]["proposers"]["ngram"] == held["ngram"]
    bad = httpx.post(
        srv.base + "/v1/completions", json={"model": "m", "prompt": "x", "speculative": {"method": "eagle"}}
    )
    assert bad.status_code == 400 and "eagle" in bad.json()["error"]["message"]
    version = httpx.get(srv.base + "/version").json()
    assert version["speculative_method"] == "auto" and version["speculative_methods"] == ["suffix", "ngram", "draft"]


def test_metrics_count_drafts_per_proposer(srv):
    client = OpenAI(base_url=srv.base + "/v1", api_key="x")
    for method in ("ngram", "suffix"):
        client.completions.create(
            model="m", prompt="a b c d " * 12, max_tokens=16, temperature=0,
            extra_body={"speculative": {"method": method, "num_draft_tokens": 3}, "ignore_eos": True},
        )  # fmt: skip
    text = httpx.get(srv.base + "/metrics").text
    for method in ("ngram", "suffix"):
        assert f'augur_spec_decode_num_drafts_total{{method="{method}"}}' in text


def test_auto_is_the_command_lines_default_and_holds_the_demo_draft():
    from server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve"])
    assert args.speculative_method == "auto"
    cfg = engine_config_from_args(args)
    assert cfg.speculative_method == "auto" and cfg.draft_model is not None
    assert isinstance(cfg, EngineConfig)
