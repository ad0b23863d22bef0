"""Where a decode step waits for the device, counted on the CPU (issue 33, item 3).

On a GPU the host waits for the device whenever it reads a device tensor (``tolist``, ``item``, ...)
and whenever it builds one from a host list (``torch.tensor(values, device=...)``, or indexing by a
list): a copy from pageable memory, which waits for all the work queued before it. A CPU has no such
waits, but the calls are the same ones, so they can be counted here, in the engine's own code, while
steps run (``loadtest.device_waits.Crossings``, whose census tool prints the same counts per method):

- a plain step reads the device once (its tokens);
- a drafting step twice: the draft's tokens once they are all drafted, then the accepted ones;
- no host list reaches the device except through a ring (engine/attention/staging.py), and nothing is
  moved to a device by hand.

``tests/test_gpu_speculation.py`` counts the waits themselves with CUDA's sync debug mode, where a GPU
is lent. Early exits (layer skipping's confidence exit) and methods with a feedback pass (lookahead,
Ouroboros) read more by design and are not counted here.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import write_eagle
from test_spec import make, pair  # noqa: F401 (a fixture)
from test_spec import prompts as spec_prompts

from engine.request.sampling_params import SamplingParams
from loadtest.device_waits import count_steps, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def start(eng, params: SamplingParams, n: int = 4) -> None:
    for i, p in enumerate(spec_prompts(n, seed=11)):
        eng.add_request(str(i), p, params)
    for _ in range(3):  # prefills, the first decodes
        eng.step()


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, num_draft_tokens=3)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True, num_draft_tokens=3)
RANDOM = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, num_draft_tokens=3)


@pytest.mark.parametrize("ahead", ["off", "on"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, RANDOM], ids=["greedy", "seeded", "random"])
def test_a_plain_step_reads_the_device_once_and_sends_it_nothing_by_hand(pair, ahead, params):  # noqa: F811
    eng = make(pair["target"], async_scheduling=ahead)
    start(eng, params)
    for seen in count_steps(eng, 8):
        assert sum(seen.reads.values()) == 1, dict(seen.reads)
        assert not seen.builds, dict(seen.builds)


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, RANDOM], ids=["greedy", "seeded", "random"])
def test_a_drafting_step_reads_the_device_twice(pair, topk, params):  # noqa: F811
    """A draft model's chains and trees: the draft's tokens in one read, then the accepted tokens."""
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=topk)
    start(eng, params)
    steps = count_steps(eng, 8)
    assert sum(seen.drafted for seen in steps) >= 6  # a fixed depth: nearly every step drafts
    for seen in steps:
        assert sum(seen.reads.values()) == (2 if seen.drafted else 1), dict(seen.reads)
        assert not seen.builds, dict(seen.builds)


def test_feature_heads_and_sampling_extras_send_nothing_by_hand(pair, tmp_path):  # noqa: F811
    """An EAGLE head (the target's features kept a step), and requests with penalties, logit bias,
    ``min_tokens`` and logprobs beside plain ones: every list goes through a ring."""
    head = write_eagle(pair["target"], tmp_path / "head")
    eng = make(pair["target"], head, speculative_method="eagle")
    start(eng, GREEDY)
    extras = SamplingParams(
        temperature=0.7, max_tokens=30, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.3,
        frequency_penalty=0.2, logit_bias={7: 2.0}, min_tokens=12, logprobs=3,
    )  # fmt: skip
    eng.add_request("extras", spec_prompts(1, seed=12)[0], extras)
    steps = count_steps(eng, 10)
    assert any(seen.drafted for seen in steps)
    for seen in steps:
        assert not seen.builds, dict(seen.builds)


def test_the_count_can_fail(pair, monkeypatch):  # noqa: F811
    """A list index in the accept step, as ``logits[rows]`` once was (the GPU's second sync a step), is
    seen; so are the reads of layer skipping's confidence exit, one a level past the first."""
    import engine.sampling.accept as accept

    eng = make(pair["target"], async_scheduling="off")
    start(eng, GREEDY)
    monkeypatch.setattr(accept, "take_rows", torch.Tensor.__getitem__)  # logits[rows], called from accept.py
    seen, *_ = count_steps(eng, 1)
    assert list(seen.builds) == [f"engine/sampling/accept.py:{_line(accept.accept_greedy, 'take_rows(logits, rows)')}"]
    monkeypatch.undo()

    eng = make(pair["target"], speculative_method="layer-skip")
    start(eng, GREEDY)
    reads = [sum(seen.reads.values()) for seen in count_steps(eng, 6) if seen.drafted]
    assert reads and all(n > 2 for n in reads), reads


def _line(func, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(func)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_the_census_tool(pair, tmp_path, capsys):  # noqa: F811
    """``python -m loadtest.device_waits``: a row per engine, sampling and kind of step, with the lines."""
    out = tmp_path / "waits.md"
    argv = ["--model", str(pair["target"]), "--draft-model", str(pair["noisy"]), "--device", "cpu"]
    argv += ["--dtype", "float32", "--engines", "plain", "draft, chains", "--sampling", "greedy", "random"]
    assert main([*argv, "--steps", "4", "--output-md", str(out)]) == 0
    table = out.read_text()
    assert table == capsys.readouterr().out
    rows = [
        line.split(" | ") for line in table.splitlines() if line.startswith("| plain |") or line.startswith("| draft")
    ]
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in rows] == [
        ("| plain", "greedy", "plain", "1.00", "0.00"),
        ("| plain", "random", "plain", "1.00", "0.00"),
        ("| draft, chains", "greedy", "drafting", "2.00", "0.00"),
        ("| draft, chains", "random", "drafting", "2.00", "0.00"),
    ]
    assert "engine/speculative/levels.py:" in table and "engine/sampling/accept.py:" in table
