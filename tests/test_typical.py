"""Medusa's typical acceptance: LOSSY and opt-in. The rule on hand-made rows; through the engine it
accepts more than exact verification and is used only by requests that ask for it; a real server
labels it in usage and metrics, applies its --typical-acceptance default only to unseeded sampling
requests that do not opt out, and refuses it where it cannot apply."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from test_medusa import target, write_heads  # noqa: F401
from test_step import make

import engine.sampling.accept as accept_mod
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import SequenceGroup
from engine.sampling.accept import RowsMetadata, accept_typical
from engine.sampling.batch import Sample
from engine.sampling.tree import DraftTree
from server.app import ServerSettings, create_app
from servers import engine_factory, serve


def sample_for(params: SamplingParams, tree: DraftTree) -> Sample:
    """A real request's first sequence, its tree's rows starting at logits row 0."""
    return Sample(SequenceGroup("r", [0], params, 0.0).seqs[0], tree, row=0, tok=0)


def test_the_rule_keeps_the_deepest_typical_path():
    V = 4
    params = SamplingParams(temperature=1.0, typical_acceptance=(0.09, 0.3))
    # root → a (node 0) → b (node 1); root → c (node 2). Row 0: the root, then one row per node.
    tree = DraftTree([1, 2, 3], [-1, 0, -1])
    flat = torch.zeros(V)  # H = log 4: threshold min(0.09, 0.3 / 4 = 0.075) = 0.075 < p = 0.25
    peaked = torch.tensor([30.0, 0.0, 0.0, 0.0])  # p(0) ≈ 1: tokens 1..3 are atypical
    logits = torch.stack([flat, peaked, flat, flat])  # rows: root, node 0, node 1, node 2
    sample = sample_for(params, tree)
    [(path, final)] = accept_typical([sample], logits, RowsMetadata(V, torch.device("cpu"), [V + 1]))
    assert path == [0]  # a is typical under the flat root; b (token 2) is not under node 0's peaked row
    assert final == 0  # sampled from node 0's row: p(0) ≈ 1
    # The threshold follows the entropy: under a flat root and epsilon 0.2, delta 2, the threshold is
    # min(0.2, 2 / 4) = 0.2 < 0.25, and both a and c are typical; the deeper path wins.
    sample = sample_for(SamplingParams(temperature=1.0, typical_acceptance=(0.2, 2.0)), tree)
    logits[1] = flat
    [(path, _)] = accept_typical([sample], logits, RowsMetadata(V, torch.device("cpu"), [V + 1]))
    assert path == [0, 1]


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="sampling"):
        SamplingParams(temperature=0.0, typical_acceptance=(0.09, 0.3))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=3, typical_acceptance=(0.09, 0.3))
    with pytest.raises(ValueError, match="epsilon"):
        SamplingParams(temperature=1.0, typical_acceptance=(0.0, 0.3))


def test_through_the_engine_it_accepts_more_and_only_when_asked(target, tmp_path, monkeypatch):  # noqa: F811
    heads = write_heads(target, tmp_path / "heads", like_target=True)
    calls = []
    real = accept_mod.ACCEPT["typical"]
    monkeypatch.setitem(accept_mod.ACCEPT, "typical", lambda s, lg, md: calls.append(len(s)) or real(s, lg, md))
    prompts = [[5 + i, 6, 7, 8] for i in range(16)]
    accepted = {}
    for name, typical in (("exact", None), ("typical", (0.3, 0.6))):
        eng = make(target, "medusa", draft_model=str(heads), num_kv_blocks=512)
        params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, num_draft_tokens=2)
        params.typical_acceptance = typical
        eng.generate(prompts, params)
        accepted[name] = eng.spec_stats.num_accepted_tokens / eng.spec_stats.num_draft_tokens
        assert bool(calls) == (typical is not None), "typical acceptance runs only for requests that ask"
    assert accepted["typical"] > accepted["exact"], accepted


@pytest.fixture(scope="module")
def lossy_server(target, tmp_path_factory):  # noqa: F811
    heads = write_heads(target, tmp_path_factory.mktemp("typical") / "heads", like_target=True)
    settings = ServerSettings(served_model_name="tiny", typical_acceptance=(0.09, 0.3))
    app = create_app(settings, engine_factory(target, draft_model=str(heads)))
    with serve(app) as served:
        yield served


def test_the_server_labels_it_lossy_wherever_it_is_used(lossy_server):
    client = OpenAI(base_url=lossy_server.base + "/v1", api_key="unused")
    kw = dict(model="tiny", prompt="hello world", max_tokens=12)
    lossy = client.completions.create(temperature=1.0, **kw).usage.model_extra["speculative"]
    assert lossy["lossy"] is True and lossy["acceptance"] == "typical (lossy)"
    # Greedy, seeded and opted-out requests stay exact under the server's default.
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        spec = client.completions.create(**extra, **kw).usage.model_extra["speculative"]
        assert spec["lossy"] is False and spec["acceptance"] == "exact"
    out = client.completions.create(temperature=1.0, extra_body={"speculative": {"typical_acceptance": False}}, **kw)
    assert out.usage.model_extra["speculative"]["lossy"] is False
    metrics = httpx.get(lossy_server.base + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("augur_spec_decode_lossy_requests_total"))
    assert 'acceptance="typical"' in line and float(line.split()[-1]) == 1.0
    # Asking for it where it cannot apply is a clear 400.
    r = httpx.post(
        lossy_server.base + "/v1/completions",
        json={**kw, "temperature": 0.0, "speculative": {"typical_acceptance": {"epsilon": 0.1, "delta": 0.3}}},
    )
    assert r.status_code == 400 and "greedy" in r.json()["error"]["message"]
