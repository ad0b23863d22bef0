"""``augur bench --methods ngram suffix layer-skip draft medusa=DIR eagle=DIR``: drafting methods side by side,
against plain decoding measured in the same run, on prompts where lookup has little to copy and where
it has much. A method that loads a draft takes it as ``METHOD=DIR`` (``draft`` alone: the demo's).

For each prompt set, temperature and concurrency: plain decoding (a method-less engine, timed before
and after the methods; the ratio is against the mean), then each method on an engine of its own, its
depth tuned by the controller as ``augur serve`` would (``--pin-depth K``: every request drafts ``K``
tokens a step, the controller's choice set aside, to compare the drafters' acceptance). Reported:
tokens/s, the ratio to plain, and the mean acceptance length (tokens per verify step).

Prompt sets:

- ``held-out``: the demo pair's held-out code prefixes (random-token prompts for another model);
- ``copy``: prompts whose continuation copies from the prompt, as in code edits and quoting: each
  held-out prefix followed by a blank line and the first half of itself again, so that continuing
  faithfully means repeating the second half.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import machine_description, run_augur
from engine.request.sampling_params import SamplingParams
from loadtest.bench_speculative import bench_prompts, result_row

PROMPT_SETS = ("held-out", "copy")


def copy_prompts(tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt, a blank line, then its first half again: the faithful continuation is a copy."""
    sep = tokenizer.encode("\n\n")
    return [p + sep + p[: len(p) // 2] for p in prompts]


def run_methods_bench(cfg: EngineConfig, args: argparse.Namespace) -> int:
    conc = sorted(args.concurrency or [1, 8])
    base = dataclasses.replace(
        cfg, max_num_seqs=max(cfg.max_num_seqs, max(conc)), speculative_method="none", draft_model=None
    )
    plain_engine = LLMEngine(base)
    n = max(args.num_prompts, max(conc))
    held_out, source = bench_prompts(plain_engine, n, args)
    sets = {"held-out": held_out, "copy": copy_prompts(plain_engine.tokenizer, held_out)}
    engines = {"none": plain_engine}
    for spec in args.methods:
        method, _, draft = spec.partition("=")  # METHOD, or METHOD=DIR for one that loads a draft
        if method in ("draft", "ouroboros", "auto") and not draft:
            draft = cfg.draft_model or ""  # the demo's draft model (auto: beside the lookups, as served)
        engines[method] = LLMEngine(dataclasses.replace(base, speculative_method=method, draft_model=draft or None))
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for e in engines.values():  # allocator, caches, the controllers' first observations
        run_augur(e, held_out[:2], 8, 2, warm)
    rows = []
    for name in args.prompt_sets:
        ps = sets[name]
        for t in args.temperatures:
            params = SamplingParams(
                temperature=t, max_tokens=args.max_tokens, ignore_eos=True, num_draft_tokens=args.pin_depth
            )
            for c in conc:
                first = run_augur(plain_engine, ps, args.max_tokens, c, params)
                cells = {m: run_augur(e, ps, args.max_tokens, c, params) for m, e in engines.items() if m != "none"}
                last = run_augur(plain_engine, ps, args.max_tokens, c, params)
                plain_tps = (first.tokens_per_s + last.tokens_per_s) / 2
                for m, r in (("none", first), *cells.items(), ("none (again)", last)):
                    rows.append({"prompts": name, **result_row(str(base.torch_dtype), t, c, m, r, plain_tps)})
    del engines, plain_engine
    gc.collect()
    report = {
        "model": str(cfg.model),
        "machine": machine_description(cfg.torch_device),
        "held_out_prompts": source,
        "num_prompts": n,
        "max_tokens": args.max_tokens,
        "config": {k: getattr(cfg, k) for k in ("num_speculative_tokens", "layer_skip_config", "spec_early_stop")},
        "pin_depth": args.pin_depth,
        "results": rows,
    }
    print(f"augur bench --methods: {report['model']} on {report['machine']}")
    print(f"{n} prompts ({source}; copy: each followed by its first half again), {args.max_tokens} tokens each")
    header = ("prompts", "T", "conc", "method", "tok/s", "vs plain", "mean acc len")
    print("  ".join(f"{h:>12}" for h in header))
    for r in rows:
        cells = (r["prompts"], f"{r['temperature']:g}", str(r["concurrency"]), r["method"])
        cells += (f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_plain']:.2f}x", f"{r['mean_acceptance_length']:.2f}")
        print("  ".join(f"{x:>12}" for x in cells))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0
