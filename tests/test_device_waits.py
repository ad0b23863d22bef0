"""Where a decode step waits for the device, counted on the CPU (issue 33, item 3).

On a GPU the host waits for the device whenever it reads a device tensor (``tolist``, ``item``, ...)
and whenever it builds one from a host list (``torch.tensor(values, device=...)``, or indexing by a
list): a copy from pageable memory, which waits for all the work queued before it. A CPU has no such
waits, but the calls are the same ones, so they can be counted here, in the engine's own code, while
steps run:

- a plain step reads the device once (its tokens);
- a drafting step twice: the draft's tokens once they are all drafted, then the accepted ones;
- no host list reaches the device except through a ring (engine/attention/staging.py).

``tests/test_gpu_speculation.py`` counts the waits themselves with CUDA's sync debug mode, where a GPU
is lent. Early exits (layer skipping's confidence exit) and methods with a feedback pass (lookahead,
Ouroboros) read more by design and are not counted here.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_eagle import write_eagle
from test_spec import make, pair  # noqa: F401 (a fixture)
from test_spec import prompts as spec_prompts
from torch.overrides import TorchFunctionMode

from engine.request.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = str(Path(__file__).resolve().parent.parent / "engine")
RING = str(Path(ENGINE) / "attention" / "staging.py")
READBACK = str(Path(ENGINE) / "runner" / "readback.py")
# The CPU attention backend writes a tree's mask into its host-side mask where the mask is a host tensor
# (on a GPU it stays on the device: build_sdpa_metadata's other branch); that read is the CPU's alone.
CPU_ONLY = str(Path(ENGINE) / "attention" / "sdpa.py")

READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero,
    torch.nonzero, torch.masked_select, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__,
}  # fmt: skip
# (torch.from_numpy never reaches a function mode; the ring is where the engine calls it.)
BUILDS = {torch.tensor, torch.as_tensor}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


def _by_list(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(p, (list, np.ndarray)) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts
    )


def _to_a_device(func, args, kwargs) -> bool:
    """``t.to(device)`` (a device given), ``t.cuda()``, ``dst.copy_(src)``: on a GPU each is a copy,
    from pageable memory where the source is a host tensor (on a CPU every tensor is one)."""
    if func is torch.Tensor.to:
        return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
    return True


def _site(frame) -> str | None:
    where = frame.f_code.co_filename
    return f"{where[len(ENGINE) - len('engine') :]}:{frame.f_lineno}" if where.startswith(ENGINE) else None


class Crossings(TorchFunctionMode):
    """Every read of a tensor on the host and every tensor built from host data, called by the engine's
    own code (the frame that calls torch is in engine/, not torch's or Triton's), by ``file:line``.
    A call of ``readback.to_host`` is one read: its transfer is one copy (``in_one_copy``), and on a
    CPU, where nothing moves, it reads each tensor as it is (so its own calls are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.builds: Counter[str] = Counter()
        self._to_host = None  # the frame of the to_host call counted last

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1)
        where = caller.f_code.co_filename
        if where == READBACK and caller.f_code.co_name == "to_host":
            if caller is not self._to_host:
                self._to_host = caller
                self.reads[_site(caller.f_back)] += 1
        elif where.startswith(ENGINE) and where not in (RING, CPU_ONLY):
            site = _site(caller)
            if func in READS:
                self.reads[site] += 1
            elif (
                func in BUILDS
                or (func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _by_list(args[1]))
                or (func in MOVES and _to_a_device(func, args, kwargs or {}))
            ):
                self.builds[site] += 1
        return func(*args, **(kwargs or {}))


def count_steps(eng, steps: int) -> list[tuple[bool, Crossings]]:
    """``steps`` steps, each with its crossings and whether it drafted."""
    out = []
    for _ in range(steps):
        drafts = eng.spec_stats.num_drafts if eng.spec_stats is not None else 0
        with Crossings() as seen:
            eng.step()
        out.append(((eng.spec_stats.num_drafts if eng.spec_stats is not None else 0) > drafts, seen))
    return out


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
    for _, seen in count_steps(eng, 8):
        assert sum(seen.reads.values()) == 1, dict(seen.reads)
        assert not seen.builds, dict(seen.builds)


@pytest.mark.parametrize("topk", [1, 2], ids=["chains", "trees"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, RANDOM], ids=["greedy", "seeded", "random"])
def test_a_drafting_step_reads_the_device_twice(pair, topk, params):  # noqa: F811
    """A draft model's chains and trees: the draft's tokens in one read, then the accepted tokens."""
    eng = make(pair["target"], pair["noisy"], spec_tree_topk=topk)
    start(eng, params)
    steps = count_steps(eng, 8)
    assert sum(drafted for drafted, _ in steps) >= 6  # a fixed depth: nearly every step drafts
    for drafted, seen in steps:
        assert sum(seen.reads.values()) == (2 if drafted else 1), dict(seen.reads)
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
    assert any(drafted for drafted, _ in steps)
    for _, seen in steps:
        assert not seen.builds, dict(seen.builds)


def test_the_count_can_fail(pair, monkeypatch):  # noqa: F811
    """A list index in the accept step, as ``logits[rows]`` once was (the GPU's second sync a step), is
    seen; so are the reads of layer skipping's confidence exit, one a level past the first."""
    import engine.sampling.accept as accept

    eng = make(pair["target"], async_scheduling="off")
    start(eng, GREEDY)
    monkeypatch.setattr(accept, "take_rows", torch.Tensor.__getitem__)  # logits[rows], called from accept.py
    (_, seen), *_ = count_steps(eng, 1)
    assert list(seen.builds) == [f"engine/sampling/accept.py:{_line(accept.accept_greedy, 'take_rows(logits, rows)')}"]
    monkeypatch.undo()

    eng = make(pair["target"], speculative_method="layer-skip")
    start(eng, GREEDY)
    reads = [sum(seen.reads.values()) for drafted, seen in count_steps(eng, 6) if drafted]
    assert reads and all(n > 2 for n in reads), reads


def _line(func, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(func)
    return first + next(i for i, line in enumerate(lines) if text in line)
