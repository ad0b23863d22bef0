"""``python -m loadtest.device_waits``: where a step waits for the device, method by method.

On a GPU the host waits for the device whenever it reads a device tensor (``tolist``, ``item``, ...)
and whenever it builds one from host data (``torch.tensor(values, device=...)``, an index by a list,
a ``.to(device)`` from pageable memory): the copy waits for all the work queued before it. A wait
stalls the host until the device catches up, so the host's work of the next step no longer overlaps
the device's. Issue 33 asks for one wait a plain step (its tokens) and the fewest a drafting step.

For each engine (the demo pair by default: plain decoding and each drafting method) and each kind of
sampling, this runs a few decode steps and counts, per step:

- *reads* and *builds*: the calls of the engine's own code that wait on a GPU, counted by a torch
  function mode (:class:`Crossings`) on any device, a CPU included, where the same calls are made;
- *syncs* (CUDA only): the synchronizations themselves, from torch's sync debug mode, each with the
  line that made it.

The table gives each per step (drafting steps and plain steps apart) and the lines that made them.
``tests/test_device_waits.py`` asserts the counts on the CPU; ``loadtest/gpu_checks.sh``'s ``waits``
stage runs this on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import engine

ENGINE = str(Path(engine.__file__).parent)  # as the engine's frames name their files
RING = str(Path(ENGINE) / "attention" / "staging.py")  # where host lists are sent, in one pinned copy
READBACK = str(Path(ENGINE) / "runner" / "readback.py")  # to_host: one read for several tensors
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
    """Every read of a tensor on the host and every tensor built from host data or moved to a device,
    called by the engine's own code (the frame that calls torch is in engine/, not torch's or
    Triton's), by ``file:line``. A call of ``readback.to_host`` is one read: its transfer is one copy
    (``in_one_copy``), and on a CPU, where nothing moves, it reads each tensor as it is."""

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


@dataclass
class StepWaits:
    drafted: bool
    reads: Counter[str]
    builds: Counter[str]
    syncs: Counter[str] = field(default_factory=Counter)  # CUDA only: sync debug mode's warnings by line


def count_steps(eng, steps: int) -> list[StepWaits]:
    """``steps`` steps of ``eng``, each with its crossings, its syncs (on CUDA) and whether it drafted."""
    cuda = eng.config.torch_device.type == "cuda"
    out = []
    for _ in range(steps):
        drafts = eng.spec_stats.num_drafts if eng.spec_stats is not None else 0
        syncs: Counter[str] = Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with Crossings() as seen:
                    eng.step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[f"{w.filename.rsplit('/', 2)[-2]}/{Path(w.filename).name}:{w.lineno}"] += 1
        drafted = (eng.spec_stats.num_drafts if eng.spec_stats is not None else 0) > drafts
        out.append(StepWaits(drafted, seen.reads, seen.builds, syncs))
    return out


# Engines on the demo pair: (name, engine config fields). Drafting methods draft at a fixed depth
# (``num_draft_tokens``), so every step drafts.
ENGINES = {
    "plain": dict(speculative_method="none", async_scheduling="off"),
    "plain, run-ahead": dict(speculative_method="none", async_scheduling="on"),
    "draft, chains": dict(speculative_method="draft", spec_tree_topk=1),
    "draft, trees": dict(speculative_method="draft", spec_tree_topk=2),
    "ngram": dict(speculative_method="ngram"),
    "suffix": dict(speculative_method="suffix"),
    "lookahead": dict(speculative_method="lookahead"),
    "layer-skip": dict(speculative_method="layer-skip"),
    "ouroboros": dict(speculative_method="ouroboros"),
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.8, seed=5),
    "random": dict(temperature=0.8, top_p=0.9),
}


def census(
    target: str,
    draft: str | None,
    device: str,
    engines: list[str],
    sampling: list[str],
    num_seqs: int = 4,
    steps: int = 8,
    depth: int = 3,
    dtype: str = "auto",
) -> list[dict]:
    """One row per engine and sampling: waits per step, drafting steps and plain steps apart."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    rows = []
    for name in engines:
        fields = dict(ENGINES[name])
        if fields["speculative_method"] in ("draft", "ouroboros"):
            if draft is None:
                continue
            fields["draft_model"] = draft
        eng = LLMEngine(EngineConfig(model=target, device=device, dtype=dtype, **fields))
        for kind in sampling:
            params = SamplingParams(
                max_tokens=(8 + steps) * (depth + 1) + 8, ignore_eos=True, num_draft_tokens=depth, **SAMPLING[kind]
            )
            for i in range(num_seqs):
                eng.add_request(f"{kind}-{i}", [5 + i, 6, 7, 8, 9, 10, 11, 5 + i, 6, 7, 8, 9], params)
            for _ in range(8):  # prefills, the first decodes (and on CUDA graphs captured, buffers grown)
                eng.step()
            waits = count_steps(eng, steps)
            while eng.has_unfinished_requests():
                eng.step()
            for drafted in (True, False):
                these = [w for w in waits if w.drafted == drafted]
                if not these:
                    continue
                total = {k: sum((getattr(w, k) for w in these), Counter()) for k in ("reads", "builds", "syncs")}
                rows.append(
                    {
                        "engine": name,
                        "sampling": kind,
                        "steps": "drafting" if drafted else "plain",
                        "count": len(these),
                        **{k: sum(c.values()) / len(these) for k, c in total.items()},
                        "sites": {k: dict(c.most_common()) for k, c in total.items()},
                        "cuda": device.startswith("cuda"),
                    }
                )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| engine | sampling | steps | n | reads / step | builds / step | syncs / step (CUDA) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        syncs = f"{r['syncs']:.2f}" if r["cuda"] else "-"
        lines.append(
            f"| {r['engine']} | {r['sampling']} | {r['steps']} | {r['count']} | {r['reads']:.2f} | "
            f"{r['builds']:.2f} | {syncs} |"
        )
    lines += ["", "Where (calls over all the steps counted):", ""]
    for r in rows:
        parts = [
            f"{k}: " + ", ".join(f"{s} x{n}" for s, n in r["sites"][k].items()) for k in r["sites"] if r["sites"][k]
        ]
        if parts:
            lines.append(f"- {r['engine']}, {r['sampling']}, {r['steps']} steps: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.device_waits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: the demo pair's)")
    ap.add_argument("--draft-model", default=None, help="draft model directory (default: the demo pair's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="ENGINE")
    ap.add_argument("--sampling", nargs="+", default=list(SAMPLING), choices=list(SAMPLING))
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3, help="the fixed draft depth of drafting methods")
    ap.add_argument("--output-md", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    from engine.assets import shipped_demo

    demo = shipped_demo()
    target = args.model or (str(demo / "target") if demo else None)
    if target is None:
        ap.error("no --model and no shipped demo pair")
    draft = args.draft_model or (str(demo / "draft") if demo and not args.model else None)
    rows: list[dict] = []
    for name in args.engines:  # the file is rewritten after each engine: a run cut short keeps what it counted
        rows += census(
            target, draft, args.device, [name], args.sampling, args.num_seqs, args.steps, args.depth, args.dtype
        )
        if args.output_md:
            Path(args.output_md).write_text(markdown(rows), encoding="utf-8")
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
