"""A paired A/B of speculation against plain decoding in one process: ``python -m loadtest.bench_ab``.

``augur bench --suite`` measures servers one after another, and on a shared host the speed drifts by
a quarter in minutes, so a ratio near 1.0 between two runs minutes apart says little about a change
of a few percent. This holds plain decoding and each method of ``--methods`` in one process, each on
an engine of its own over the same model, and runs them back to back for each round and category of
the benchmark suite (``loadtest/prompts/suite.jsonl``), in alternating order (plain first in even
rounds, last in odd), so that the host's drift touches both sides of each ratio alike.

At concurrency 1 a round takes the next prompt of each category; above it, the first
``--concurrency`` prompts of each, all in flight at once. Every run drafts from fresh stores (its own
tenant, as a fresh API key is served), so suffix decoding never replays an earlier round's answer.
Reported per method: each category's median ratio of plain's seconds over the method's across the
rounds, and their geometric mean (above 1: the method is faster). Chat prompts are rendered with the
model's chat template.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

from engine.assets import DEMO_DIR
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import machine_description, run_augur
from engine.request.sampling_params import SamplingParams
from loadtest.prompts import load_prompts
from loadtest.suite import by_category

PLAIN = "none"


def prompt_ids(engine: LLMEngine, prompt) -> list[int]:
    tok = engine.tokenizer
    if prompt.messages is not None and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(prompt.as_messages(), add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt.as_text())


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds until every prompt (all in flight at once) has its ``max_tokens``."""
    return run_augur(engine, prompts, params.max_tokens, len(prompts), params).seconds


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run(args) -> dict:
    def engine(method: str) -> LLMEngine:
        kw = dict(model=args.model, device=args.device, compile=args.compile, speculative_method=method)
        if method != PLAIN and args.draft_model:
            kw["draft_model"] = args.draft_model
        return LLMEngine(EngineConfig(**kw))

    engines = {m: engine(m) for m in [PLAIN, *args.methods]}
    groups = by_category(load_prompts(args.prompts))
    first = next(iter(engines.values()))
    ids = {c: [prompt_ids(first, p) for p in ps] for c, ps in groups.items()}
    tenants = itertools.count()

    def params() -> SamplingParams:  # a tenant of its own: fresh drafting stores
        return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                              seed=args.seed, tenant=f"ab-{next(tenants)}")  # fmt: skip

    for e in engines.values():  # warm-up: first calls, and a compile where one is on
        run_once(e, ids[next(iter(ids))][:2], params())
    ratios = {m: {c: [] for c in ids} for m in args.methods}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for c, prompts in ids.items():
            batch = prompts[: args.concurrency] if args.concurrency > 1 else [prompts[r % len(prompts)]]
            seconds = {m: run_once(engines[m], batch, params()) for m in order}
            for m in args.methods:
                ratios[m][c].append(seconds[PLAIN] / seconds[m])
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    report = dict(machine=machine_description(first.runner.device), temperature=args.temperature,
                  concurrency=args.concurrency, rounds=args.rounds, max_tokens=args.max_tokens, compile=args.compile,
                  methods={})  # fmt: skip
    for m in args.methods:
        med = {c: statistics.median(v) for c, v in ratios[m].items()}
        report["methods"][m] = dict(by_category=med, geometric_mean=geometric_mean(med.values()),
                                    rounds=ratios[m])  # fmt: skip
        cells = " ".join(f"{c} {v:.3f}" for c, v in med.items())
        print(f"T = {args.temperature}, c = {args.concurrency}: {m} / plain {geometric_mean(med.values()):.3f} "
              f"({cells})", flush=True)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft-model", default=str(DEMO_DIR / "draft"), help="for the methods that load one")
    ap.add_argument("--methods", nargs="+", default=["auto"], help="speculative methods, each against plain")
    ap.add_argument("--prompts", default="suite", help="a shipped set or a .jsonl with a category on every line")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="the requests' sampling seed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", default="off", choices=["auto", "on", "off"])
    ap.add_argument("--output", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    report = run(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
