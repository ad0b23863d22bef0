"""``augur tune-layer-skip``: on a tiny model whose layers are made redundant on purpose (their
output projections zeroed, so each is the identity), Bayesian optimisation of tokens/s finds a skip
set that leaves out only redundant sublayers, writes a JSON that round-trips, and the engine serves
it with the plain decoder's greedy output. The search's own test times each run by a cost model of
its forwards, not by the clock, so that its verdict is the tuner's and not the host's."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors.torch import load_file, save_file
from test_step import make
from test_step import prompts as repetitive_prompts

import engine.offline.tune_layer_skip as tune_mod
from conftest import build_model_dir
from engine.config import EngineConfig
from engine.models.layer_skip import LayerSkip
from engine.offline.tune_layer_skip import starting_points, tune_layer_skip
from engine.request.sampling_params import SamplingParams
from server.cli import main

REAL = {1, 4}  # the layers that compute something; the other four are the identity


@pytest.fixture(scope="module")
def redundant_target(tmp_path_factory, tokenizer_dir):
    path = build_model_dir(
        tmp_path_factory.mktemp("tune") / "t", tokenizer_dir, "LlamaForCausalLM", std=0.3, num_hidden_layers=6
    )
    w = load_file(path / "model.safetensors")
    for name in w:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and layer not in REAL and name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()  # attention and MLP add nothing to the residual stream: skipping them is exact
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_first_trials_are_informed_guesses():
    points = starting_points(8)
    assert points[0] == LayerSkip() and LayerSkip.middle(8) in points
    assert len(points) == len(set(points))
    assert starting_points(2) == [LayerSkip()]  # nothing to skip by default in a 2-layer model


@pytest.fixture
def modelled_seconds(monkeypatch):
    """Each of the tuner's runs (real: its tokens, steps and acceptance are the engine's) timed by a cost
    model instead of the clock: a target forward costs 1, a draft level 0.1 (embedding and head) plus 0.9
    times the share of sublayers it computes."""
    real = tune_mod.run_augur

    def run_augur(engine, prompts, max_tokens, concurrency, params=None):
        drafted = engine.spec_stats.num_draft_tokens
        r = real(engine, prompts, max_tokens, concurrency, params)
        levels = engine.spec_stats.num_draft_tokens - drafted  # one request at a time: one level per token
        skip, sublayers = engine.proposer.skip, 2 * engine.runner.model.num_layers
        level_cost = 0.1 + 0.9 * (1 - (len(skip.attn) + len(skip.mlp)) / sublayers)
        return dataclasses.replace(r, seconds=r.engine_steps + levels * level_cost)

    monkeypatch.setattr(tune_mod, "run_augur", run_augur)


def test_the_tuner_finds_the_redundant_sublayers(redundant_target, modelled_seconds):
    ps = repetitive_prompts(4, seed=5)
    config = EngineConfig(model=str(redundant_target), device="cpu", block_size=4, num_speculative_tokens=4)
    result = tune_layer_skip(config, ps, trials=30, max_tokens=32, progress=False)
    assert len(result.trials) == 30 and result.trials[0].skip == LayerSkip()  # the informed guesses come first
    skipped = result.best.skip.attn | result.best.skip.mlp
    assert skipped, "skipping identity layers costs no acceptance and saves time: something must be skipped"
    assert not skipped & REAL, f"a layer that computes something was skipped: {result.best}"
    # Only identity sublayers are left out, so the draft is the target: it accepts what drafting nothing
    # away (the target drafting for itself) accepts.
    assert result.best.mean_acceptance_length == result.trials[0].mean_acceptance_length > 3


def test_the_command_writes_a_config_the_server_loads(redundant_target, tmp_path, capsys):
    ps = repetitive_prompts(4, seed=5)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": " ".join(map(str, p))}) + "\n" for p in ps))
    out = tmp_path / "skip.json"
    argv = ["tune-layer-skip", "--model", str(redundant_target), "--device", "cpu", "--prompts"]
    argv += [str(tmp_path / "prompts.jsonl"), "--trials", "4", "--max-tokens", "16", "--output", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "trial" in captured.err  # the result, and the progress bar
    data = json.loads(out.read_text())
    skip = LayerSkip.load(out)  # what --layer-skip-config reads
    assert skip == LayerSkip.from_dict(data) and data["tuned"]["trials"] == 4
    assert skip in starting_points(6)  # 4 trials: the informed guesses only

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].delta_token_ids for o in make(redundant_target).generate(ps, params)]
    eng = make(redundant_target, "layer-skip", layer_skip_config=str(out))
    assert eng.proposer.skip == skip
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain
