"""``augur bench --speculative``: does speculation pay, in every cell, and is it stable?

One run measures, on the same prompts (the demo pair's held-out code prefixes when serving the
demo), for each dtype × temperature × concurrency: plain decoding, trees and chains (depth tuned by
the controller), as tokens/s and as a ratio to plain decoding measured in the same cell.
Then the mean acceptance length of the default configuration (``augur serve``'s: chains on CPU,
trees on GPU) on several *fresh* engines (a new controller each time, as a fresh server), whose
spread says whether the controller is stable. And the acceptance at a fixed depth (controller off),
which measures the drafts alone.

On a machine whose speed drifts between runs (a shared 2-core host moves by ±20%), ``--repeats N``
measures each cell's three configurations N times, interleaved (plain, trees, chains, plain, ...),
and reports per configuration the median tokens/s and the median of its ratios to the plain run of
the same round: a drift slower than a round moves both sides of each ratio alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
from pathlib import Path

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import demo_prompts, machine_description, make_prompts, run_augur
from engine.request.sampling_params import SamplingParams
from engine.speculative.methods import resolve_method

TARGET_RATIO = 0.97  # speculation vs plain decoding, every cell
TARGET_SPREAD = 0.10  # mean acceptance length across fresh engines


def run_spec_bench(cfg: EngineConfig, args: argparse.Namespace) -> int:
    cfg = dataclasses.replace(cfg, speculative_method=resolve_method(cfg.speculative_method, cfg.draft_model))
    if cfg.speculative_method == "none":
        raise ValueError("--speculative needs a proposer (--draft-model, or the demo pair)")
    conc = sorted(args.concurrency or [1, 8, 32])
    cfg = dataclasses.replace(cfg, max_num_seqs=max(cfg.max_num_seqs, max(conc)))
    dtypes = args.dtypes or ["float32", "bfloat16"]
    rows, prompts, source, machine = [], None, "", ""
    for dtype in dtypes:
        tree = LLMEngine(dataclasses.replace(cfg, dtype=dtype, spec_tree_topk=max(2, cfg.spec_tree_topk)))
        chain = LLMEngine(dataclasses.replace(cfg, dtype=dtype, spec_tree_topk=1))
        if prompts is None:
            prompts, source = bench_prompts(tree, max(args.num_prompts, max(conc)), args)
            machine = machine_description(tree.device)
        for e in (tree, chain):  # warm-up: allocator, caches, the controller's first observations
            run_augur(e, prompts[:2], 8, 2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for t in args.temperatures:
            base = SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True)
            for c in conc:
                ps = prompts[: max(args.num_prompts, c)]
                # Plain decoding runs on the default's engine: two engines of one model differ by a few
                # percent on a CPU (where their memory landed), which is not what the ratio is about.
                own = chain if cfg.spec_tree_topk == 1 else tree
                runs = {
                    "plain": (own, dataclasses.replace(base, speculative=False)),
                    "trees": (tree, base),
                    "chains": (chain, base),
                }
                rounds = [
                    {name: run_augur(e, ps, args.max_tokens, c, params) for name, (e, params) in runs.items()}
                    for _ in range(max(args.repeats, 1))
                ]
                for name in runs:
                    rows.append(cell_row(dtype, t, c, name, rounds))
        depth = cfg.num_speculative_tokens
        for t in args.temperatures:  # the drafts alone: a fixed depth, the controller off
            fixed = SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True, num_draft_tokens=depth)
            for name, e in (("trees", tree), ("chains", chain)):
                r = run_augur(e, prompts[: args.num_prompts], args.max_tokens, 1, fixed)
                rows.append(result_row(dtype, t, 1, f"{name}@K{depth}", r, None))
        del tree, chain
        gc.collect()
    mals = []
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(args.fresh_runs):  # a fresh engine each time: a new controller, no history
        e = LLMEngine(dataclasses.replace(cfg, dtype=dtypes[0]))
        mals.append(run_augur(e, prompts[: args.num_prompts], args.max_tokens, 1, greedy).mean_acceptance_length)
        del e
        gc.collect()
    report = {
        "model": str(cfg.model),
        "proposer": cfg.speculative_method,
        "draft": cfg.draft_model,
        "machine": machine,
        "prompts": source,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "repeats": max(args.repeats, 1),
        "config": {k: getattr(cfg, k) for k in ("num_speculative_tokens", "spec_tree_topk", "spec_tree_budget")},
        "default": "chains" if cfg.spec_tree_topk == 1 else "trees",
        "results": rows,
        "fresh_runs_mean_acceptance_length": mals,
    }
    _print(report)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def bench_prompts(engine: LLMEngine, n: int, args) -> tuple[list[list[int]], str]:
    ps = demo_prompts(engine.tokenizer, engine.model_path, n)
    if ps is not None:
        return (ps * (-(-n // len(ps))))[:n], "the demo pair's held-out prompts"
    lo, hi = args.prompt_lens
    return make_prompts(n, lo, hi, len(engine.tokenizer)), "random token prompts"


def cell_row(dtype: str, t: float, c: int, method: str, rounds: list[dict]) -> dict:
    """One configuration of a cell over its interleaved rounds: medians, ratios to the same round's plain run."""
    runs = [r[method] for r in rounds]
    row = result_row(dtype, t, c, method, runs[0], None)
    row["tokens_per_s"] = statistics.median(r.tokens_per_s for r in runs)
    row["ratio_vs_plain"] = statistics.median(r[method].tokens_per_s / r["plain"].tokens_per_s for r in rounds)
    row["mean_acceptance_length"] = statistics.median(r.mean_acceptance_length for r in runs)
    row["target_forwards_per_token"] = statistics.median(r.engine_steps / r.tokens for r in runs)
    row["repeats"] = len(runs)
    return row


def result_row(dtype: str, t: float, c: int, method: str, r, plain_tps: float | None) -> dict:
    return {
        "dtype": dtype,
        "temperature": t,
        "concurrency": c,
        "method": method,
        "tokens_per_s": r.tokens_per_s,
        "ratio_vs_plain": None if plain_tps is None else r.tokens_per_s / plain_tps,
        "mean_acceptance_length": r.mean_acceptance_length,
        "target_forwards_per_token": r.engine_steps / r.tokens,
        "tokens": r.tokens,
    }


def _print(report: dict) -> None:
    print(f"augur bench --speculative: {report['model']} ({report['proposer']}) on {report['machine']}")
    print(f"{report['num_prompts']} prompts ({report['prompts']}), {report['max_tokens']} output tokens each", end="")
    reps = report.get("repeats", 1)
    print(f"; each cell {reps} interleaved rounds, medians" if reps > 1 else "")
    header = ("dtype", "T", "conc", "method", "tok/s", "vs plain", "mean acc len", "fwd/token")
    print("  ".join(f"{h:>12}" for h in header))
    for r in report["results"]:
        cells = (
            r["dtype"],
            f"{r['temperature']:g}",
            str(r["concurrency"]),
            r["method"],
            f"{r['tokens_per_s']:.1f}",
            "-" if r["ratio_vs_plain"] is None else f"{r['ratio_vs_plain']:.2f}x",
            f"{r['mean_acceptance_length']:.2f}",
            f"{r['target_forwards_per_token']:.3f}",
        )
        print("  ".join(f"{x:>12}" for x in cells))
    default = report["default"]
    worst = min((r for r in report["results"] if r["method"] == default), key=lambda r: r["ratio_vs_plain"])
    ok = worst["ratio_vs_plain"] >= TARGET_RATIO
    where = f"{worst['dtype']}, T={worst['temperature']:g}, c={worst['concurrency']}"
    verdict = "met" if ok else "NOT met"
    print(f"worst cell of the default ({default}): {worst['ratio_vs_plain']:.2f}x plain ({where}); ", end="")
    print(f"target >= {TARGET_RATIO}x: {verdict}")
    mals = report["fresh_runs_mean_acceptance_length"]
    if len(mals) >= 2:
        spread = (max(mals) - min(mals)) / statistics.mean(mals)
        print(
            f"mean acceptance length over {len(mals)} fresh engines: {', '.join(f'{m:.2f}' for m in mals)}; "
            f"spread {spread:.1%} (target < {TARGET_SPREAD:.0%}: {'met' if spread < TARGET_SPREAD else 'NOT met'})"
        )
